"""Compact target distributions: top-K probabilities plus the remaining tail mass.

A full Qwen2.5 distribution is 151,936 floats (600 KB); top-64 ids + probs is ~770 bytes and
keeps almost all of the mass at the positions that matter. Losses treat the tail as one bucket.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CompactDist:
    ids: torch.Tensor  # (N, K) int64 token ids, most probable first
    probs: torch.Tensor  # (N, K) float32 probabilities at temperature 1 (tail = 1 - sum)

    @property
    def tail(self) -> torch.Tensor:
        return (1.0 - self.probs.sum(-1)).clamp_min(0.0)  # (N,)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def select(self, index) -> "CompactDist":
        return CompactDist(self.ids[index], self.probs[index])

    @staticmethod
    def cat(parts: list["CompactDist"]) -> "CompactDist":
        k = max(p.ids.shape[1] for p in parts)
        pad = lambda t, v: torch.nn.functional.pad(t, (0, k - t.shape[1]), value=v)
        return CompactDist(torch.cat([pad(p.ids, 0) for p in parts]), torch.cat([pad(p.probs, 0.0) for p in parts]))


def compress(logits: torch.Tensor, top_k: int = 64, temperature: float = 1.0) -> CompactDist:
    """(N, V) logits -> CompactDist with the top_k most probable tokens (top_k >= V keeps everything)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    top = torch.topk(probs, min(top_k, probs.shape[-1]), dim=-1)
    return CompactDist(top.indices, top.values)
