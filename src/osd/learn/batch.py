"""Distillation on replay items: the draft's logits at the supervised positions only, and losses on them.

Only the hidden states at positions P-1 go through the LM head, so a 151,936-token vocabulary costs
(positions x V), not (tokens x V).
"""
from __future__ import annotations

import torch

from osd.learn.buffer import ReplayItem
from osd.learn.compact import CompactDist
from osd.learn.losses import distill_loss, mapped_bucket_log_probs, tv_distance
from osd.learn.trainable import head_logits_at, trunk_features
from osd.models.vocab_map import restrict_to_draft, target_to_draft, to_target_ids, vocab_ids_of


def draft_logits_at(draft_model, items: list[ReplayItem], split: int = 0, rows_only: bool = True) -> torch.Tensor:
    """(sum of positions, V') draft logits aligned with the items' targets (index P-1 for token P), over the
    draft's own head (V' < V for a derived draft: models/vocab_map.py maps them).

    split > 0: layers below `split` are frozen; their output is taken from item.features when an item
    holds it, else computed (no grad) and kept on the item for the next time; rows_only: the last layer
    runs at the supervised positions only (learn/trainable.py, same values).
    """
    width = max(len(it.tokens) for it in items)
    input_ids = torch.zeros(len(items), width, dtype=torch.long)  # (B, T) right-padded
    mask = torch.zeros(len(items), width, dtype=torch.long)
    rows, cols = [], []
    for b, it in enumerate(items):
        input_ids[b, : len(it.tokens)] = torch.tensor(it.tokens)
        mask[b, : len(it.tokens)] = 1
        rows += [b] * len(it.positions)
        cols += [p - 1 for p in it.positions]
    rows, cols = torch.tensor(rows), torch.tensor(cols)
    if split == 0:
        hidden = draft_model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # (B, T, H)
        return draft_model.lm_head(hidden[rows, cols]).float()  # (N, V)
    missing = [b for b, it in enumerate(items) if it.features is None]
    if missing:
        computed = trunk_features(draft_model, input_ids[missing], split)
        for j, b in enumerate(missing):
            items[b].features = computed[j, : len(items[b].tokens)].to(torch.bfloat16)
    features = torch.zeros(len(items), width, items[0].features.shape[-1])
    for b, it in enumerate(items):
        features[b, : len(it.tokens)] = it.features[: len(it.tokens)].float()
    return head_logits_at(draft_model, features, split, rows, cols, rows_only)


def items_loss(draft_model, items: list[ReplayItem], loss: str = "forward_kl", beta: float = 0.5,
               temperature: float = 1.0, split: int = 0, rows_only: bool = True) -> torch.Tensor:
    """A draft with a restricted head (models/vocab_map.py) learns the target conditioned on its vocabulary."""
    target = restrict_to_draft(draft_model, CompactDist.cat([it.target for it in items]))
    return distill_loss(draft_logits_at(draft_model, items, split, rows_only), target, loss, beta, temperature=temperature)


def position_chunks(items: list[ReplayItem], max_positions: int) -> list[list[ReplayItem]]:
    """Consecutive runs of items holding at most `max_positions` supervised positions each (an item with more is a
    run of its own), in order."""
    chunks, size = [], max_positions
    for it in items:
        if chunks and size + len(it.positions) <= max_positions:
            chunks[-1].append(it)
            size += len(it.positions)
        else:
            chunks.append([it])
            size = len(it.positions)
    return chunks


@torch.no_grad()
def acceptance_on(draft_model, items: list[ReplayItem], batch_size: int = 8, split: int = 0,
                  pause=lambda: None, chunks=None) -> dict:
    """Greedy agreement (draft argmax == target argmax) and expected acceptance 1 - TV on items;
    `correct` is the agreement per position (for paired comparisons). `pause()` runs before each chunk: `batch_size`
    items, or `chunks(items)`'s lists where given."""
    accepted, correct = [], []
    vocab_ids = vocab_ids_of(draft_model)  # a restricted head: measured over it (mapped_bucket_log_probs)
    lut = None if vocab_ids is None else target_to_draft(vocab_ids, int(draft_model.config.vocab_size))
    runs = chunks(items) if chunks is not None else [items[i : i + batch_size] for i in range(0, len(items), batch_size)]
    for chunk in runs:
        pause()
        logits = draft_logits_at(draft_model, chunk, split)  # (N, V'): the draft's own head
        target = CompactDist.cat([it.target for it in chunk])
        correct += (to_target_ids(draft_model, logits.argmax(-1)) == target.ids[:, 0]).tolist()
        t, d = mapped_bucket_log_probs(logits, target, lut)
        accepted += (1 - tv_distance(t, d)).tolist()
    return acceptance_summary(correct, accepted)


def acceptance_summary(correct: list[bool], accepted: list[float]) -> dict:
    """acceptance_on's answer from its per-position lists: greedy agreement, expected acceptance (1 - TV), both
    lists ("correct", "accepted")."""
    n = len(correct)
    return {"greedy_agreement": sum(correct) / n if n else None, "expected_acceptance": sum(accepted) / n if n else None,
            "positions": n, "correct": correct, "accepted": accepted}
