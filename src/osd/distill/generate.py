"""Batched decoding that records the target's distribution at every generated position.

Sample sources (GKD family, PAPER.md section 3):
  teacher      the target generates (the only source the disk cache stores: it does not change)
  student      the draft generates (no gradient through sampling); the target scores every position
  mix_token    each token comes from the target with probability `teacher_ratio`, else from the draft
  mix_request  each request is wholly teacher- or student-generated, teacher with probability `teacher_ratio`
Several prompts share one forward (left padding): decoding is memory-bound, so B rows cost little more
than one. Rows are seeded one by one, so a row's sample does not depend on its batch neighbours.
"""
from __future__ import annotations

import hashlib

import torch
from transformers import DynamicCache

from osd.distill.cache import DecodeSettings
from osd.errors import InvalidArgument
from osd.learn.compact import CompactDist, compress

SOURCES = ("teacher", "student", "mix_token", "mix_request")


class _Rows:
    """One model decoding B left-padded rows with a shared KV cache."""

    def __init__(self, model, prompts: list[list[int]], pad_id: int):
        width = max(len(p) for p in prompts)
        self.model, self.cache = model, DynamicCache()
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        self.mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):] = torch.tensor(p)
            self.mask[b, width - len(p):] = 1
        self.positions = (self.mask.cumsum(-1) - 1).clamp_min(0)
        self.logits = self._forward(ids, self.positions)

    def _forward(self, ids, positions) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()  # (B, V)

    def advance(self, tokens: torch.Tensor) -> None:
        self.mask = torch.cat([self.mask, torch.ones(len(tokens), 1, dtype=torch.long)], dim=1)
        self.positions = self.positions[:, -1:] + 1
        self.logits = self._forward(tokens[:, None], self.positions)


def row_seed(seed: int, prompt: list[int]) -> int:
    return int(hashlib.sha256(f"{seed}:{prompt}".encode()).hexdigest()[:12], 16)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))


@torch.no_grad()
def decode_batch(target, prompts: list[list[int]], settings: DecodeSettings, eos_ids: set[int], pad_id: int = 0,
                 draft=None, source: str = "teacher", teacher_ratio: float = 0.5) -> list[tuple[list[int], CompactDist]]:
    """-> per prompt (response ids, target CompactDist at each response position)."""
    if source not in SOURCES:
        raise InvalidArgument(f"sample source must be one of {SOURCES}, got {source!r}")
    if source != "teacher" and draft is None:
        raise InvalidArgument(f"sample source {source!r} needs a draft model")
    if not 0.0 <= teacher_ratio <= 1.0:
        raise InvalidArgument(f"teacher_ratio must be in [0, 1], got {teacher_ratio}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidArgument("every prompt needs at least one token")
    gens = [torch.Generator().manual_seed(row_seed(settings.seed, p)) for p in prompts]
    coin = lambda b: float(torch.rand(1, generator=gens[b])) < teacher_ratio
    teacher_rows = [source == "teacher" or (source == "mix_request" and coin(b)) for b in range(len(prompts))]
    target_rows = _Rows(target, prompts, pad_id)
    draft_rows = _Rows(draft, prompts, pad_id) if source != "teacher" else None
    vocab = target_rows.logits.shape[-1]
    responses = [[] for _ in prompts]
    dists: list[list[CompactDist]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(settings.max_new_tokens):
        compact = compress(target_rows.logits, settings.top_k)
        chosen = []
        for b in range(len(prompts)):
            from_teacher = teacher_rows[b] if source != "mix_token" else coin(b)
            logits = target_rows.logits[b] if from_teacher else draft_rows.logits[b, :vocab]
            token = _pick(logits, settings.temperature, gens[b])
            chosen.append(token)
            if not done[b]:
                responses[b].append(token)
                dists[b].append(compact.select(slice(b, b + 1)))
                done[b] = token in eos_ids
        if all(done):
            break
        tokens = torch.tensor(chosen)
        target_rows.advance(tokens)
        if draft_rows is not None:
            draft_rows.advance(tokens)
    return [(r, CompactDist.cat(d)) for r, d in zip(responses, dists)]
