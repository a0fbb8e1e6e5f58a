"""Many sequences over one target: cache slots, and one forward that feeds rows of several of them.

The scheduler (schedule/scheduler.py) advances every running sequence in one step. A `Slots` backend holds one KV
cache per slot and answers:
  feed(feeds)            [Feed(slot, tokens, n_logits)] -> per feed (n_logits, V) float32 logits at its last
                         positions (n_logits = 0: prompt rows, no logits); one pass over each weight matrix where
                         the backend can
  rollback(slot, length) keep the first `length` cached tokens of the slot
  reset(slot), length(slot), n_slots,
  exclusive (True: only these slots write their caches, so a slot's cached prefix may serve the next request)
  keep_features (Q4Slots only: set True, and each feed also leaves in `features`, per feed, (n_logits, H) the LM
                 head's input at the rows it returned logits for: what a feature head reads, propose/feature_head.py)

`Q4Slots`: osd's Q4 kernel (models/q4_runner.py `forward_rows`): the matrices see every row of every slot in one
pass; norms, RoPE, the cache write and attention run row by row on the row's own slot, so a row's logits are bitwise
those it gets fed alone (tests/schedule/test_scheduler.py). Prompt rows ride along in the same pass (chunked
prefill). `RunnerSlots`: one runner per slot (the torch path: a CachedModel per slot over the same weights), fed one
after another: sequences interleave step by step, nothing is shared per pass. `RunnerSlots.single` wraps a runner
that holds one sequence only (llama.cpp here): one slot, requests take turns.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch

from osd.errors import ContextTooLong, InvalidArgument
from osd.models.cached import CachedModel
from osd.models.q4_runner import Q4Runner, Rows
from osd.models.runner import copy_positions
from osd.models.tree_rows import accepted_moves, tree_rows


@dataclass
class Feed:
    slot: int
    tokens: list[int]
    n_logits: int  # logits for the last n_logits tokens (0: none, prompt rows)
    tree: list[int] | None = None  # a token tree: the last len(tree) tokens are its nodes, tree[j] node j's parent
    # (-1: the token before the nodes); each node attends to its own path only (models/tree_rows.py)


class Q4Slots:
    """`n_slots` KV caches over one Q4Runner's weights; every feed of a step in one forward (one pass per matrix).
    With one slot, that slot is the runner's own cache (its `length` stays what a single request leaves, as on the
    other backends; others may feed it: `exclusive` is False). With several, every slot has a cache of its own,
    allocated on first use (pages touched only as they fill), which nothing else writes: `exclusive`, so the scheduler
    may reuse what a slot holds for the next request with the same prefix."""

    supports_features = True

    def __init__(self, runner, n_slots: int, n_ctx: int | None = None, exclusive: bool | None = None):
        """n_ctx: each slot's context (at most the runner's); exclusive: own caches for every slot (default: with
        several slots; models/q4_batch.py always asks for them)."""
        self.runner, self.n_slots = runner, int(n_slots)
        self.context_window = min(n_ctx or runner.context_window, runner.context_window)
        self.exclusive = self.n_slots > 1 if exclusive is None else exclusive
        self._caches: list = [None if self.exclusive else runner._kv] + [None] * (self.n_slots - 1)
        self._lengths = [0] * self.n_slots  # slot 0's is the runner's unless exclusive
        self.keep_features = False
        self.features: list[torch.Tensor] = []  # the last feed's, per feed (n_logits, H), where keep_features

    def length(self, slot: int) -> int:
        return self.runner.length if slot == 0 and not self.exclusive else self._lengths[slot]

    def _set_length(self, slot: int, length: int) -> None:
        if slot == 0 and not self.exclusive:
            self.runner.length = length
        else:
            self._lengths[slot] = length

    supports_trees = True

    def reset(self, slot: int) -> None:
        self._set_length(slot, 0)

    def rollback(self, slot: int, length: int) -> None:
        if length < 0:
            raise InvalidArgument(f"rollback length must be >= 0, got {length}")
        self._set_length(slot, min(self.length(slot), length))

    @torch.inference_mode()
    def copy_prefix(self, source: int, slot: int, n: int) -> None:
        """Give `slot` the keys/values of `source`'s first n positions (exclusive slots; `source` is untouched): bitwise
        what feeding those tokens would write, since each row is computed on its own (a running request's prompt
        prefix, shared by a new one, copied in ~ms instead of fed again)."""
        if not self.exclusive or source == slot or not 0 <= n <= self.length(source):
            raise InvalidArgument(f"cannot copy {n} positions from slot {source} to slot {slot}")
        if self._caches[slot] is None:
            self._caches[slot] = self.runner.new_cache(self.context_window)
        copy_positions(self._caches[source], self._caches[slot], n)
        self._set_length(slot, n)

    @torch.inference_mode()
    def keep_path(self, slot: int, base: int, path: list[int]) -> None:
        """After a tree feed whose nodes start at cache index `base`: keep the accepted nodes `path` (root's child
        first) where a chain would have written them (cache index base + depth) and drop the rest, so the cache is
        bitwise what feeding the path as a chain leaves (tests/models/test_tree_rows.py)."""
        moves = accepted_moves(base, path)
        if moves:
            src, dst = (torch.tensor(x, dtype=torch.long) for x in zip(*moves))
            for k_cache, v_cache in self._caches[slot]:
                k_cache[:, dst] = k_cache[:, src]
                v_cache[:, dst] = v_cache[:, src]
        self.rollback(slot, base + len(path))

    @torch.inference_mode()
    def feed(self, feeds: list[Feed]) -> list[torch.Tensor]:
        if len(feeds) == 1 and len(feeds[0].tokens) > self.runner.chunk_rows and feeds[0].tree is None:  # a lone prompt
            f, step = feeds[0], self.runner.chunk_rows
            parts, features = [], []
            for i in range(0, len(f.tokens), step):
                parts.append(self._feed([Feed(f.slot, f.tokens[i : i + step],
                                              max(0, f.n_logits - (len(f.tokens) - i - step)))])[0])
                features += self.features
            self.features = [torch.cat(features)] if self.keep_features else []
            return [torch.cat(parts)]
        return self._feed(feeds)

    def _feed(self, feeds: list[Feed]) -> list[torch.Tensor]:
        ids, groups, keep = [], [], []
        for f in feeds:
            start, length = len(ids), self.length(f.slot)
            if length + len(f.tokens) > self.context_window:
                raise ContextTooLong(f"{length + len(f.tokens)} tokens exceed the Q4 backend's context of "
                                     f"{self.context_window}")
            if self._caches[f.slot] is None:
                self._caches[f.slot] = self.runner.new_cache(self.context_window)
            ids += f.tokens
            tree = tree_rows(length, len(f.tokens) - len(f.tree), f.tree) if f.tree is not None else None
            groups.append(Rows(start, len(ids), torch.arange(length, length + len(f.tokens)), self._caches[f.slot], tree))
            keep += range(len(ids) - min(f.n_logits, len(f.tokens)), len(ids))
        width = self.runner.shape.hidden
        if not ids:
            self.features = [torch.empty(0, width) for _ in feeds] if self.keep_features else []
            return [torch.empty(0, self.runner.vocab_size) for _ in feeds]
        hidden = self.runner.forward_rows(self.runner.embed(ids), [g for g in groups if g.stop > g.start])  # (M, hidden)
        features = self.runner.features(hidden[keep]) if keep else torch.empty(0, width)  # (sum n, H)
        logits = self.runner.logits_of_features(features) if keep else torch.empty(0, self.runner.vocab_size)
        out, kept, at = [], [], 0  # logits (sum n, V) cut per feed
        for f in feeds:
            n = min(f.n_logits, len(f.tokens))
            out.append(logits[at : at + n])
            kept.append(features[at : at + n])
            at += n
            self._set_length(f.slot, self.length(f.slot) + len(f.tokens))
        self.features = kept if self.keep_features else []
        return out


class RunnerSlots:
    """One runner per slot, fed one after another (no shared pass): for backends without a multi-sequence forward."""

    supports_trees = False
    supports_features = False  # the torch and llama.cpp runners hand back logits only

    def __init__(self, runners: list, exclusive: bool = False):
        """exclusive: nothing but these slots feeds the runners (the scheduler may reuse a slot's cached prefix)."""
        self.runners, self.n_slots, self.exclusive = runners, len(runners), exclusive

    @classmethod
    def single(cls, runner) -> "RunnerSlots":
        return cls([runner])

    def length(self, slot: int) -> int:
        return self.runners[slot].length

    def reset(self, slot: int) -> None:
        self.runners[slot].reset()

    def rollback(self, slot: int, length: int) -> None:
        self.runners[slot].rollback(length)

    def feed(self, feeds: list[Feed]) -> list[torch.Tensor]:
        out = []
        for f in feeds:
            if not f.tokens:
                out.append(torch.empty(0, self.runners[f.slot].vocab_size))
                continue
            logits = self.runners[f.slot].feed(f.tokens, n_logits=max(f.n_logits, 1))  # n = 0 means all to some runners
            out.append(logits[len(logits) - f.n_logits :] if f.n_logits else logits[:0])
        return out


def slots_for(target, n_slots: int) -> Q4Slots | RunnerSlots:
    """The multi-sequence form of a target runner: Q4Slots over osd's Q4 kernel, a CachedModel per slot over a torch
    model, and one slot (requests take turns) for a runner without either (llama.cpp)."""
    if isinstance(target, Q4Runner):
        return Q4Slots(target, n_slots)
    if isinstance(target, CachedModel):
        if n_slots == 1:
            return RunnerSlots.single(target)
        return RunnerSlots([CachedModel(target.model) for _ in range(n_slots)], exclusive=True)
    return RunnerSlots.single(target)
