"""Compact target distributions: top-K probabilities plus the remaining tail mass.

A full Qwen2.5 distribution is 151,936 floats (600 KB); top-64 ids + probs is ~770 bytes and
keeps almost all of the mass at the positions that matter. Losses treat the tail as one bucket.
Stored at temperature 1; `tempered_log_buckets` re-tempers one, exactly for the listed tokens and with a stated
approximation for the tail (whose shape is not stored).
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
    """(N, V) logits -> CompactDist with the top_k most probable tokens (top_k >= V keeps everything), best first.

    On osd's compiled kernels (rows_linear.cpp softmax_top_k) when they are built: the online learner compresses every
    verified position in the serving thread, and torch's softmax + topk took ~0.6 ms a row there (~10% of a step at 8
    clients, AMD EPYC). Elsewhere torch's; the two agree to float rounding (ties: the compiled one keeps the lower id)."""
    from osd.models.kernels import load as load_kernels  # (here: the models package imports this module)

    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    k = min(top_k, scaled.shape[-1])
    module = load_kernels(allow_fallback=True, use="top-k of the learner's targets") if scaled.dim() == 2 else None
    if module is not None and scaled.shape[0]:
        ids, probs = module.softmax_top_k(scaled, k)
        return CompactDist(ids, probs)
    top = torch.topk(torch.softmax(scaled, dim=-1), k, dim=-1)
    return CompactDist(top.indices, top.values)


def tempered_log_buckets(dist: CompactDist, temperature: float, vocab_size: int) -> torch.Tensor:
    """(N, K+1) log-probabilities of the K listed tokens and the tail bucket at `temperature`, from a distribution
    stored at temperature 1: p_T(i) = p(i)^(1/T) / Z for each listed token i.

    Approximation (the tail's shape is not stored): its mass t is taken as spread evenly over the n = V - listed
    other tokens, so the tail bucket weighs n * (t / n)^(1/T) before normalising. Exact when the tail is flat or
    K covers the vocabulary (then the tail bucket is empty); for an uneven tail it overstates the tempered tail
    when T > 1 and understates it when T < 1 (Jensen: x^(1/T) is concave, resp. convex). Entries of probability 0
    (padding of CompactDist.cat) stay empty.
    """
    logp = torch.log(dist.probs) / temperature  # (N, K), -inf where p = 0
    if dist.ids.shape[-1] >= vocab_size:  # nothing unlisted: an empty tail bucket, as at temperature 1
        log_tail = torch.full_like(logp[:, 0], float("-inf"))
    else:
        n = (vocab_size - (dist.probs > 0).sum(-1)).clamp_min(1).float()  # (N,) unlisted tokens
        tail = dist.tail.clamp_min(1e-10)  # the floor of losses.bucket_log_probs: finite KL
        log_tail = n.log() + (tail.log() - n.log()) / temperature  # (N,) log of n * (t / n)^(1/T)
    return torch.log_softmax(torch.cat([logp, log_tail[:, None]], -1), dim=-1)  # (N, K+1)
