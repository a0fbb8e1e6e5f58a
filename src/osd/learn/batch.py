"""Distillation on replay items: the draft's logits at the supervised positions only, and losses on them.

Only the hidden states at positions P-1 go through the LM head, so a 151,936-token vocabulary costs
(positions x V), not (tokens x V).
"""
from __future__ import annotations

import torch

from osd.learn.buffer import ReplayItem
from osd.learn.compact import CompactDist
from osd.learn.losses import bucket_log_probs, distill_loss, tv_distance


def draft_logits_at(draft_model, items: list[ReplayItem]) -> torch.Tensor:
    """(sum of positions, V) draft logits aligned with the items' targets (index P-1 for token P)."""
    width = max(len(it.tokens) for it in items)
    input_ids = torch.zeros(len(items), width, dtype=torch.long)  # (B, T) right-padded
    mask = torch.zeros(len(items), width, dtype=torch.long)
    rows, cols = [], []
    for b, it in enumerate(items):
        input_ids[b, : len(it.tokens)] = torch.tensor(it.tokens)
        mask[b, : len(it.tokens)] = 1
        rows += [b] * len(it.positions)
        cols += [p - 1 for p in it.positions]
    hidden = draft_model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # (B, T, H)
    picked = hidden[torch.tensor(rows), torch.tensor(cols)]  # (N, H)
    return draft_model.lm_head(picked).float()  # (N, V)


def items_loss(draft_model, items: list[ReplayItem], loss: str = "forward_kl", beta: float = 0.5,
               temperature: float = 1.0) -> torch.Tensor:
    target = CompactDist.cat([it.target for it in items])
    return distill_loss(draft_logits_at(draft_model, items), target, loss, beta, temperature=temperature)


@torch.no_grad()
def acceptance_on(draft_model, items: list[ReplayItem], batch_size: int = 8) -> dict:
    """Greedy agreement (draft argmax == target argmax) and expected acceptance 1 - TV on items."""
    agree, beta, n = 0.0, 0.0, 0
    for i in range(0, len(items), batch_size):
        chunk = items[i : i + batch_size]
        logits = draft_logits_at(draft_model, chunk)
        target = CompactDist.cat([it.target for it in chunk])
        agree += (logits.argmax(-1) == target.ids[:, 0]).float().sum().item()
        t, d = bucket_log_probs(logits, target)
        beta += (1 - tv_distance(t, d)).sum().item()
        n += logits.shape[0]
    return {"greedy_agreement": agree / n if n else None, "expected_acceptance": beta / n if n else None, "positions": n}
