"""Replay buffer fed only by verification results (no extra target forward).

An item is one step's training signal: the token sequence the draft saw and, at chosen positions P,
the target's distribution for the token at P (compact top-K + tail). The draft logits that produced
the proposal at P sit at index P-1 of a forward over `tokens`: the loss is aligned there.
Eviction: FIFO by position count (oldest items go first when capacity is exceeded); with `keep_unused` (the serving
learner's), an item no optimizer step has used yet stays past the capacity until it is used or `keep_unused` seconds
old (up to `hard_cap` positions), so a burst of requests larger than what the learner takes in per update loses no
sample that has not aged out: used items go first, then the aged ones, the oldest first.
Items of one request are merged (their contexts nest), so one draft forward trains on all of a request's positions
instead of one forward per step; also when other requests' steps came between (continuous batching).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from osd.learn.compact import CompactDist, compress

MODES = ("mismatch", "all")
MERGE_WINDOW = 64  # newest items searched for an earlier step of the same request (ReplayBuffer.add)


@dataclass
class ReplayItem:
    tokens: list[int]  # context the draft saw (left-truncated to max_context), ending at max(positions) - 1
    positions: list[int]  # index P (in tokens' frame) of each supervised token; draft logits index P - 1
    target: CompactDist  # (len(positions), K) target distribution at each P
    request_id: str
    draft_version: int
    created_at: float
    features: torch.Tensor | None = None  # frozen-trunk hidden states for `tokens` (see learn/trainable.py)
    used: int = 0  # optimizer steps whose batch held this item

    def extends(self, earlier: "ReplayItem") -> bool:
        """Same request, and `earlier`'s context is a prefix of this one's (a later step of it)."""
        n = len(earlier.tokens)
        return earlier.request_id == self.request_id and n <= len(self.tokens) and earlier.tokens == self.tokens[:n]

    def merged_into(self, earlier: "ReplayItem") -> "ReplayItem":
        """One item for both: one forward over the longer context supervises every position."""
        return ReplayItem(self.tokens, earlier.positions + self.positions, CompactDist.cat([earlier.target, self.target]),
                          self.request_id, self.draft_version, earlier.created_at)


def item_from_step(record, mode: str = "mismatch", top_k: int = 64, max_context: int = 512,
                   now: float | None = None) -> ReplayItem | None:
    """Turn a StepRecord into a ReplayItem, or None when it carries no signal.

    mismatch: only the first rejected proposal (the paper's choice); nothing at a step without a rejection.
    all: every position on the output trajectory whose target distribution verification computed: the accepted
      proposals, then the first rejected one or, when none was rejected, the bonus position. A step at k = 0 (the
      adaptive policy found speculation would not pay) still gives its one position, so a draft that starts too
      far from the target to be used can learn its way into use.
    """
    if mode not in MODES:
        raise ValueError(f"replay mode must be one of {MODES}, got {mode!r}")
    k, n_acc = len(record.proposed), record.n_accepted
    if mode == "mismatch" and n_acc == k:
        return None
    rows = [n_acc] if mode == "mismatch" else list(range(n_acc + 1))
    base = len(record.context)
    tokens = record.context + record.proposed[: max(rows)]  # the draft saw proposals before each row
    cut = stable_cut(len(tokens), max_context)
    # row j predicts the token at base + j; the rows are consecutive: a view, not a copy of (rows x V) logits
    target = compress(record.target_logits[rows[0] : rows[-1] + 1], top_k)
    return ReplayItem(tokens[cut:], [base + j - cut for j in rows], target, record.request_id,
                      record.draft[1], time.monotonic() if now is None else now)


def stable_cut(length: int, max_context: int) -> int:
    """Tokens to drop from the front of a `length`-token context so that at most `max_context` remain, moved in steps
    of half of it: a request's consecutive steps keep the same start, so their items nest and merge into one
    (ReplayBuffer.add). Cut one token at a time, every step of a request past max_context started an item of its own
    (a chat stream's long prompts: items of one or two positions, each a forward over the whole context)."""
    over = length - max_context
    if over <= 0:
        return 0
    step = max(1, max_context // 2)
    return -(-over // step) * step


def fresh_first(rng, items: list, n: int) -> list:
    """Up to n distinct items: those no optimizer step has used yet, oldest first (the nearest to ageing out), then a
    random sample of the rest."""
    fresh = [it for it in items if not it.used][:n]
    taken = {id(it) for it in fresh}
    rest = [it for it in items if id(it) not in taken]
    return fresh + rng.sample(rest, min(len(rest), n - len(fresh)))


def mismatch_from_all(every: ReplayItem | None, record) -> ReplayItem | None:
    """The "mismatch" item of a step, cut from its "all" item (the same context; the rejected row is the last row of
    "all"), so one step's top-k is computed once when both are wanted (the guard's every-position item and the
    training item): equal to item_from_step(record, "mismatch", ...) with the same top_k and max_context."""
    if every is None or record.n_accepted == len(record.proposed):
        return None
    return ReplayItem(every.tokens, every.positions[-1:], every.target.select(slice(-1, None)), every.request_id,
                      every.draft_version, every.created_at)


def items_of_step(record, mode: str, top_k: int, max_context: int, guard: bool,
                  now: float | None = None) -> tuple[ReplayItem | None, ReplayItem | None]:
    """One step's (training item, every-position item for the guard or None): what the learner observes. With the
    guard the top-k is computed once (the training item is cut from the every-position one). The serving replicas of
    a cluster build these where the step ran and ship them to the one learner (cluster/samples.py)."""
    if not guard:
        return item_from_step(record, mode, top_k, max_context, now), None
    every = item_from_step(record, "all", top_k, max_context, now)
    return (every if mode == "all" else mismatch_from_all(every, record)), every


class ReplayBuffer:
    """Thread-safe FIFO of ReplayItems bounded by the number of supervised positions."""

    def __init__(self, capacity: int = 4096, clock=time.monotonic, on_evict=None, keep_unused: float = 0.0,
                 hard_cap: int | None = None):
        self.capacity, self.clock = capacity, clock
        self.keep_unused = keep_unused  # seconds an unused item outlives the capacity (0: plain FIFO)
        self.hard_cap = hard_cap if hard_cap is not None else 4 * capacity  # positions, unused items included
        self.on_evict = on_evict  # called with each evicted item (learn/rehearsal.py keeps a sample of them)
        self._items: deque[ReplayItem] = deque()
        self._positions = 0
        self._lock = threading.Lock()
        self.added = 0  # monotonic counters
        self.evicted = 0
        self.evicted_unused = 0  # positions evicted before any optimizer step used them (aged out, or past hard_cap)

    def add(self, item: ReplayItem) -> None:
        with self._lock:
            new_positions = len(item.positions)
            at = self._earlier_step_of(item)
            if at is not None:
                earlier = self._items[at]
                del self._items[at]
                self._positions -= len(earlier.positions)
                item = item.merged_into(earlier)
            self._items.append(item)
            self._positions += len(item.positions)
            self.added += new_positions
            if self.keep_unused:
                self._evict_used_first()
                return
            while self._positions > self.capacity and len(self._items) > 1:
                self._remove(0)

    def _earlier_step_of(self, item: ReplayItem) -> int | None:
        """The index of the item this one extends (an earlier step of the same request), searched among the newest
        MERGE_WINDOW items: under continuous batching the steps of several requests interleave, and merging only with
        the newest item would leave one item per step, each a forward over the whole context for a few positions."""
        for i in range(len(self._items) - 1, max(-1, len(self._items) - 1 - MERGE_WINDOW), -1):
            if self._items[i].request_id == item.request_id:
                return i if item.extends(self._items[i]) else None
        return None

    def _evict_used_first(self) -> None:
        """Over capacity: evict used or aged-out items, oldest first; unused ones only past hard_cap."""
        now, i = self.clock(), 0
        while self._positions > self.capacity and i < len(self._items) - 1:
            item = self._items[i]
            if item.used or now - item.created_at >= self.keep_unused or self._positions > self.hard_cap:
                self._remove(i)
            else:
                i += 1
        if self._positions > self.capacity:  # all unused and fresh: kept, up to hard_cap
            while self._positions > self.hard_cap and len(self._items) > 1:
                self._remove(0)

    def _remove(self, index: int) -> None:
        old = self._items[index]
        del self._items[index]
        self._positions -= len(old.positions)
        self.evicted += len(old.positions)
        self.evicted_unused += 0 if old.used else len(old.positions)
        if self.on_evict is not None:
            self.on_evict(old)

    def unused(self) -> int:
        """Positions no optimizer step has used yet."""
        with self._lock:
            return sum(len(it.positions) for it in self._items if not it.used)

    def __len__(self) -> int:
        """Supervised positions held."""
        return self._positions

    def oldest_age(self) -> float:
        with self._lock:
            return self.clock() - self._items[0].created_at if self._items else 0.0

    def snapshot(self) -> list[ReplayItem]:
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._positions = 0
