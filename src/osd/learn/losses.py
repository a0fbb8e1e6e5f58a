"""Distillation losses of the GKD family (PAPER.md section 3), as pure functions.

All distances compare a target and a draft distribution over "buckets": with full target logits the
buckets are the vocabulary; with a compact target (top-K + tail) they are the K listed tokens plus
one tail bucket holding the rest of each distribution's mass. When K covers the vocabulary both
forms agree exactly. Shapes: N positions, V vocabulary, B buckets.

Directions are explicit: forward_kl = KL(target || draft) (mode covering; the same gradient as soft
cross-entropy), reverse_kl = KL(draft || target) (mode seeking).
"""
from __future__ import annotations

import torch

from osd.learn.compact import CompactDist, tempered_log_buckets

LOSSES = ("forward_kl", "reverse_kl", "jsd", "tv", "reference_mix")


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) over the last dim from log-probabilities; 0 * log 0 = 0. (..., B) -> (...).

    The empty buckets of a (log_a = -inf) are left out before the product, not after: 0 * (-inf - -inf) is NaN,
    and autograd carries that NaN through a `where` that drops the term (reverse KL's empty draft buckets)."""
    live = log_a > float("-inf")
    return (log_a.exp() * torch.where(live, log_a - log_b, torch.zeros_like(log_a))).sum(-1)
    # note: F.kl_div(input, target) computes KL(target || input): its argument order is the trap avoided here


def forward_kl(target_logp: torch.Tensor, draft_logp: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) per position: (N, B), (N, B) -> (N,)."""
    return _kl(target_logp, draft_logp)


def reverse_kl(target_logp: torch.Tensor, draft_logp: torch.Tensor) -> torch.Tensor:
    """KL(draft || target) per position: (N, B), (N, B) -> (N,)."""
    return _kl(draft_logp, target_logp)


def jsd(target_logp: torch.Tensor, draft_logp: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised JSD: beta*KL(target||m) + (1-beta)*KL(draft||m), m = beta*target + (1-beta)*draft.

    The mixture formula vanishes at both ends, so (as in GKD/TRL) beta = 0 is defined as
    forward_kl and beta = 1 as reverse_kl. Symmetric in (target, draft) at beta = 0.5.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return forward_kl(target_logp, draft_logp)
    if beta == 1.0:
        return reverse_kl(target_logp, draft_logp)
    m = beta * target_logp.exp() + (1 - beta) * draft_logp.exp()  # (log-sum-exp's gradient is NaN where both are 0)
    log_m = torch.where(m > 0, m.clamp_min(1e-30).log(), torch.full_like(m, float("-inf")))
    return beta * _kl(target_logp, log_m) + (1 - beta) * _kl(draft_logp, log_m)


def tv_distance(target_logp: torch.Tensor, draft_logp: torch.Tensor) -> torch.Tensor:
    """Total variation 0.5 * sum |target - draft| = 1 - beta (the direct acceptance surrogate). (N,)."""
    return 0.5 * (target_logp.exp() - draft_logp.exp()).abs().sum(-1)


def reference_mix(target_logp: torch.Tensor, draft_logp: torch.Tensor) -> torch.Tensor:
    """What the reference OSD code calls "jsd": 0.9 * forward_kl + 0.1 * reverse_kl."""
    return 0.9 * forward_kl(target_logp, draft_logp) + 0.1 * reverse_kl(target_logp, draft_logp)


def bucket_log_probs(draft_logits: torch.Tensor, target: torch.Tensor | CompactDist, temperature: float = 1.0):
    """-> (target_logp, draft_logp), each (N, B).

    draft_logits: (N, V). target: full logits (N, V') or CompactDist (top-K at temperature 1).
    The target is tempered like the draft: full logits exactly; a compact target exactly on its listed tokens and
    approximately on its tail bucket (compact.tempered_log_buckets states how).
    """
    draft_logp = torch.log_softmax(draft_logits.float() / temperature, dim=-1)  # (N, V)
    if isinstance(target, torch.Tensor):
        v = min(draft_logp.shape[-1], target.shape[-1])
        target_logp = torch.log_softmax(target.float()[:, :v] / temperature, dim=-1)
        return target_logp, torch.log_softmax(draft_logp[:, :v], dim=-1)
    repeats = repeated_ids(target.ids, target.probs)
    top = draft_logp.gather(-1, target.ids).masked_fill(repeats, float("-inf"))  # (N, K)
    draft_tail = draft_logp.scatter(-1, target.ids, float("-inf")).logsumexp(-1)  # (N,) exact rest of the draft
    draft_buckets = torch.cat([top, draft_tail[:, None]], -1)  # (N, K+1)
    if temperature != 1.0:
        return tempered_log_buckets(target, temperature, draft_logp.shape[-1]), draft_buckets
    covers_vocab = target.ids.shape[-1] >= draft_logp.shape[-1]
    target_tail = torch.zeros_like(draft_tail) if covers_vocab else target.tail.clamp_min(1e-10)  # floor: finite KL
    listed = target.probs.clamp_min(1e-10).masked_fill(repeats, 0.0)  # the floor as the tail's: reverse KL finite
    target_buckets = torch.cat([listed, target_tail[:, None]], -1)  # (N, K+1)
    return torch.log(target_buckets), draft_buckets  # log 0 = -inf: an empty bucket (a repeat's, both sides)


def repeated_ids(ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """(N, K) -> bool (N, K): the columns that list an id another column of the row lists already and with no less
    probability (the first of equals kept). A target restricted to a draft's vocabulary (models/vocab_map.py
    restrict_compact) fills the places of tokens outside the map with the first in-map token at probability 0, and
    CompactDist.cat pads with token 0: such a column's draft bucket must be empty, or the draft's probability of the
    token counts once per repeat (the distances other than forward KL, which reads only the target's non-empty
    buckets, then push the draft off the very token the target lists, and reverse KL is infinite)."""
    same = ids[:, :, None] == ids[:, None, :]  # (N, K, K): [i, j] column j lists column i's id
    p_i, p_j = probs[:, :, None], probs[:, None, :]
    earlier = torch.ones(ids.shape[-1], ids.shape[-1], dtype=torch.bool).tril(diagonal=-1)  # [i, j]: j < i
    return (same & ((p_j > p_i) | ((p_j == p_i) & earlier))).any(-1)  # (a column is never its own repeat)


def mapped_bucket_log_probs(draft_logits: torch.Tensor, target: CompactDist, lut: torch.Tensor | None):
    """bucket_log_probs (temperature 1) of a draft whose head covers part of the target's vocabulary (lut: target id ->
    draft id, -1 outside; models/vocab_map.py), over the draft's own head: the buckets of its logits expanded to the
    target's vocabulary with -inf outside the map, without building that (N, V) tensor (a held-out evaluation of the
    cheap draft spent most of its time there: 151,936 columns against its 16,384). lut None: a full head
    (bucket_log_probs itself)."""
    if lut is None:
        return bucket_log_probs(draft_logits, target)
    draft_logp = torch.log_softmax(draft_logits.float(), dim=-1)  # (N, V')
    ids = lut[target.ids]  # (N, K) draft ids, -1 outside the map
    none = draft_logp.shape[-1]  # an extra column of -inf: where a listed token is outside the map
    padded = torch.cat([draft_logp, draft_logp.new_full((draft_logp.shape[0], 1), float("-inf"))], -1)
    index = torch.where(ids >= 0, ids, torch.full_like(ids, none))
    repeats = repeated_ids(index, target.probs)  # (several tokens outside the map share the -inf column: empty)
    top = padded.gather(-1, index).masked_fill(repeats, float("-inf"))  # (N, K): -inf outside the map
    draft_tail = padded.scatter(-1, index, float("-inf")).logsumexp(-1)  # (N,) the draft's mass on unlisted tokens
    target_tail = target.tail.clamp_min(1e-10)  # (the floor of bucket_log_probs: finite KL)
    target_buckets = torch.cat([target.probs, target_tail[:, None]], -1)
    return torch.log(target_buckets), torch.cat([top, draft_tail[:, None]], -1)


def distill_loss(draft_logits: torch.Tensor, target: torch.Tensor | CompactDist, loss: str = "forward_kl",
                 beta: float = 0.5, mask: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Mean distance over unmasked positions. draft_logits (N, V); mask (N,) bool/float (1 = train)."""
    target_logp, draft_logp = bucket_log_probs(draft_logits, target, temperature)
    if loss == "forward_kl":
        per = forward_kl(target_logp, draft_logp)
    elif loss == "reverse_kl":
        per = reverse_kl(target_logp, draft_logp)
    elif loss == "jsd":
        per = jsd(target_logp, draft_logp, beta)
    elif loss == "tv":
        per = tv_distance(target_logp, draft_logp)
    elif loss == "reference_mix":
        per = reference_mix(target_logp, draft_logp)
    else:
        raise ValueError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
    if mask is None:
        return per.mean()
    mask = mask.float()
    return (per * mask).sum() / mask.sum().clamp_min(1.0)
