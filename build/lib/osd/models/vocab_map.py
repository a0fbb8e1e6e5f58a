"""A draft whose LM head covers only some of the target's tokens: the map draft id -> target id.

A derived draft (models/derived.py) keeps the full input embedding (it must read any token the target
emits) but its LM head has N rows, row i scoring target token `vocab_ids[i]`. The map lives on the model's
config (`osd_vocab_ids`, a sorted list), so it travels with deep copies, checkpoints and save_pretrained.

Two directions, one per use:
- evaluation (no gradient): draft logits -> the target's vocabulary with -inf outside the map
  (`in_target_vocab`). Exact: the draft proposes nothing outside its map, so its probability there is 0,
  and argmax, TV and acceptance computed on the result are those of the served draft.
- training: the target's compact distribution -> the draft's vocabulary (`restrict_to_draft`). The
  target's mass on tokens outside the map is dropped and the rest renormalised (the target conditioned on
  the map): a forward KL against the unrestricted target would be infinite wherever the target puts mass
  the draft cannot hold, and its gradient would only push every in-map logit up. The tail bucket (mass
  beyond the target's top-K) is treated as in-map; it is small at K = 64.
"""
from __future__ import annotations

import torch

from osd.learn.compact import CompactDist

CONFIG_KEY = "osd_vocab_ids"


def vocab_ids_of(model) -> torch.Tensor | None:
    """(N,) target ids covered by the model's LM head, or None for a head over the whole vocabulary."""
    ids = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    return None if ids is None else torch.as_tensor(ids, dtype=torch.long)


def set_vocab_ids(model, vocab_ids: torch.Tensor) -> None:
    setattr(model.config, CONFIG_KEY, [int(i) for i in vocab_ids])


def target_to_draft(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) lookup: target id -> draft id, -1 where the map does not cover it."""
    lut = torch.full((vocab_size,), -1, dtype=torch.long)
    lut[vocab_ids] = torch.arange(len(vocab_ids))
    return lut


def expand_logits(logits: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(M, N) draft-vocabulary logits -> (M, V) target-vocabulary logits, -inf outside the map."""
    full = torch.full((logits.shape[0], vocab_size), float("-inf"), dtype=logits.dtype)
    full[:, vocab_ids] = logits
    return full


def in_target_vocab(model, logits: torch.Tensor) -> torch.Tensor:
    """A model's (M, N') head logits in the target's vocabulary (unchanged for a full head). No gradient use."""
    vocab_ids = vocab_ids_of(model)
    return logits if vocab_ids is None else expand_logits(logits, vocab_ids, int(model.config.vocab_size))


def restrict_compact(target: CompactDist, lut: torch.Tensor) -> CompactDist:
    """A target CompactDist over target ids -> one over draft ids, conditioned on the map (see module doc).

    Entries outside the map get probability 0 and the id of the position's first in-map entry (a repeat with
    no mass keeps the bucket arithmetic exact); a position with no in-map entry keeps only its tail.
    """
    draft_ids = lut[target.ids]  # (M, K), -1 outside
    inside = draft_ids >= 0
    probs = torch.where(inside, target.probs, torch.zeros_like(target.probs))
    first = torch.gather(draft_ids, -1, inside.float().argmax(-1, keepdim=True)).squeeze(-1).clamp_min(0)  # (M,)
    ids = torch.where(inside, draft_ids, first[:, None])
    kept = probs.sum(-1, keepdim=True) + target.tail[:, None]  # (M, 1) in-map mass (tail counted in)
    return CompactDist(ids, probs / kept.clamp_min(1e-12))


def restrict_to_draft(model, target: CompactDist) -> CompactDist:
    """The target distribution in the model's head vocabulary (unchanged for a full head)."""
    vocab_ids = vocab_ids_of(model)
    if vocab_ids is None:
        return target
    return restrict_compact(target, target_to_draft(vocab_ids, int(model.config.vocab_size)))


def to_target_ids(model, draft_ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary token ids (e.g. an argmax) -> target ids."""
    vocab_ids = vocab_ids_of(model)
    return draft_ids if vocab_ids is None else vocab_ids[draft_ids]
