"""A draft's vocabulary that follows the traffic: swap the map's least-used rows for tokens the target emits and the
draft cannot propose (a derived draft's LM head covers N of the target's tokens, models/vocab_map.py).

A derived draft's map is chosen when it is built, by counting dataset texts (prompts and reference answers). What
the draft must propose is what the target says, and an instruct target says things no dataset holds: on code test
requests 10% of the bundled target's greedy tokens lie outside the shipped cheap draft's map ('```' alone 1%, 'Certainly',
' Below', 'Sure', '###', '**:'), 14% on chat. A position whose token is off the map can never be accepted, and
the learner cannot learn it: its loss conditions the target on the map (`restrict_compact`).

`TokenCounts` counts the target's tokens at the positions the learner observes (decayed per update, so the counts
follow a shift); `choose_swap` pairs the most counted tokens off the map with the least counted ones on it, never a
special token, each pair only when the added token is counted more; `swap_head` rebuilds the head over the new map
(kept tokens keep their rows, new ones start from the base's own LM head rows, models/derived.py `base_head_rows`)
and returns what `undo` needs. The head keeps its size: a proposal costs what it cost.
Replayed with the serving recipe (288 optimizer steps each, test requests 0-299, held-out the next 40, Intel Xeon):
held-out agreement 0.539 with up to 64 swaps an update (62 in all) against 0.520 without on code (paired on the same
positions: 111 gained, 61 lost, z 3.8), 0.275 against 0.264 on chat (48 swaps; 63 / 35, z 2.8); control 0.304 and
0.214 (benchmarks/learning/pair-vocab-swap-{code,chat}300-intel.json, `osd bench pair`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from osd.models.derived import base_head_rows
from osd.models.eos import token_ids_of
from osd.models.vocab_map import set_vocab_ids, vocab_ids_of


class TokenCounts:
    """Decayed counts of the target's tokens over the vocabulary (float, so a decay keeps its proportions)."""

    def __init__(self, vocab_size: int, decay: float = 0.9):
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        self.decay = decay

    def add(self, ids: torch.Tensor) -> None:
        ids = ids.reshape(-1).long()
        ids = ids[(ids >= 0) & (ids < self.counts.shape[0])]
        self.counts.index_add_(0, ids, torch.ones(ids.shape[0]))

    def age(self) -> None:
        """One update's decay: a token the traffic stopped using fades by `decay` an update."""
        self.counts.mul_(self.decay)


def choose_swap(counts: torch.Tensor, vocab_ids: torch.Tensor, keep: list[int], max_swap: int,
                min_count: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(add, drop): up to `max_swap` token ids off the map counted at least `min_count`, most counted first (ties: the
    lower id), each paired with an id on the map, least counted first (ties: the higher id), never one of `keep`; a
    pair is kept only where the added token is counted more than the dropped one. Both sorted by pairing order."""
    if max_swap <= 0 or len(vocab_ids) == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    vocab_ids = vocab_ids.long()
    outside = counts.clone().double()
    outside[vocab_ids] = -1.0
    order = torch.argsort(-outside, stable=True)[:max_swap]
    add = order[outside[order] >= max(min_count, 1e-12)]
    inside = vocab_ids[~torch.isin(vocab_ids, torch.as_tensor(list(keep), dtype=torch.long))]
    # least counted first; among equals the higher id (a derived map fills with the lowest ids: keep those longest)
    by_id = inside.flip(0)
    least = by_id[torch.argsort(counts[by_id].double(), stable=True)][: len(add)]
    n = min(len(add), len(least))
    pairs = counts[add[:n]].double() > counts[least[:n]].double()
    n = int(pairs.long().cumprod(0).sum()) if n else 0  # counts fall along add and rise along least: a prefix
    return add[:n].clone(), least[:n].clone()


@dataclass
class HeadState:
    """What `undo` puts back: the head module and the map before a swap."""
    head: nn.Module
    vocab_ids: torch.Tensor


def swap_head(model, add: torch.Tensor, drop: torch.Tensor, new_rows=None) -> HeadState | None:
    """Give `model` a new LM head over (map - drop) + add, sorted: kept tokens keep their rows, added ones take
    `new_rows(ids)` (default `base_head_rows(model)`: the base's full LM head), bias 0. None (nothing changed) when
    there is nothing to swap. A new frozen module, not the old one changed in place: a copy that shares the old head
    (a replay's never-trained control, frozen_trunk_copy) keeps it."""
    vocab_ids = vocab_ids_of(model)
    if vocab_ids is None or len(add) == 0:
        return None
    if bool((vocab_ids[1:] <= vocab_ids[:-1]).any()):
        raise ValueError("a draft's map must be sorted (models/vocab_map.py)")
    if len(add) != len(drop):
        raise ValueError(f"a swap adds as many tokens as it drops ({len(add)} != {len(drop)})")
    head = model.get_output_embeddings()
    new_ids = torch.cat([vocab_ids[~torch.isin(vocab_ids, drop)], add.long()]).sort().values
    new_rows = new_rows or base_head_rows(model)
    kept = torch.isin(new_ids, vocab_ids)  # (both maps sorted: a kept token's old row is where searchsorted finds it)
    old_row = torch.searchsorted(vocab_ids, new_ids[kept])
    added = new_ids[~kept]  # sorted, as `new_rows` returns them in the order asked
    swapped = nn.Linear(head.in_features, len(new_ids), bias=head.bias is not None, dtype=head.weight.dtype)
    with torch.no_grad():
        swapped.weight[kept] = head.weight[old_row]
        swapped.weight[~kept] = new_rows(added.tolist()).to(head.weight.dtype)
        if head.bias is not None:
            swapped.bias.zero_()
            swapped.bias[kept] = head.bias[old_row]
    model.set_output_embeddings(swapped.requires_grad_(False))
    set_vocab_ids(model, new_ids)
    return HeadState(head, vocab_ids.clone())


def undo(model, state: HeadState | None) -> None:
    """Put back the head and the map `swap_head` replaced (None: nothing to undo)."""
    if state is None:
        return
    model.set_output_embeddings(state.head)
    set_vocab_ids(model, state.vocab_ids)


def special_ids_of(config) -> list[int]:
    """The config's eos / bos / pad ids (each an int or a list): tokens a swap never drops."""
    return sorted(token_ids_of(config, keys=("eos_token_id", "bos_token_id", "pad_token_id")))


def head_name(model) -> str | None:
    """The LM head weight's parameter name (what a checkpoint saves once the map was swapped); None for a head
    without a plain weight (a LoRA-wrapped head while a derived draft heals, distill/heal.py)."""
    weight = getattr(model.get_output_embeddings(), "weight", None)
    return None if weight is None else next((name for name, p in model.named_parameters() if p is weight), None)
