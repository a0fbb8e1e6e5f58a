"""Pure sampling helpers: logits -> warped probabilities, and drawing from them.

Target and draft logits go through the same warping (temperature, top-k, top-p) so that rejection
sampling reproduces the target's warped distribution exactly: the same distribution plain target
sampling with these settings draws from.
"""
from __future__ import annotations

import torch


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p.

    temperature must be > 0 (greedy never calls this). Ties at the top-k / top-p boundary are kept.
    """
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
        drop_sorted = mass_before >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from a (V,) probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
