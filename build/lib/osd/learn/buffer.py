"""Replay buffer fed only by verification results (no extra target forward).

An item is one step's training signal: the token sequence the draft saw and, at chosen positions P,
the target's distribution for the token at P (compact top-K + tail). The draft logits that produced
the proposal at P sit at index P-1 of a forward over `tokens`: the loss is aligned there.
Eviction: FIFO by position count (oldest items go first when capacity is exceeded).
Consecutive items of one request are merged (their contexts nest), so one draft forward trains on all
of a request's positions instead of one forward per step.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from osd.learn.compact import CompactDist, compress

MODES = ("mismatch", "all")


@dataclass
class ReplayItem:
    tokens: list[int]  # context the draft saw (left-truncated to max_context), ending at max(positions) - 1
    positions: list[int]  # index P (in tokens' frame) of each supervised token; draft logits index P - 1
    target: CompactDist  # (len(positions), K) target distribution at each P
    request_id: str
    draft_version: int
    created_at: float
    features: torch.Tensor | None = None  # frozen-trunk hidden states for `tokens` (see learn/trainable.py)

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
    cut = max(0, len(tokens) - max_context)
    target = compress(record.target_logits[rows], top_k)  # row j predicts the token at base + j
    return ReplayItem(tokens[cut:], [base + j - cut for j in rows], target, record.request_id,
                      record.draft[1], time.monotonic() if now is None else now)


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

    def __init__(self, capacity: int = 4096, clock=time.monotonic, on_evict=None):
        self.capacity, self.clock = capacity, clock
        self.on_evict = on_evict  # called with each evicted item (learn/rehearsal.py keeps a sample of them)
        self._items: deque[ReplayItem] = deque()
        self._positions = 0
        self._lock = threading.Lock()
        self.added = 0  # monotonic counters
        self.evicted = 0

    def add(self, item: ReplayItem) -> None:
        with self._lock:
            new_positions = len(item.positions)
            if self._items and item.extends(self._items[-1]):
                earlier = self._items.pop()
                self._positions -= len(earlier.positions)
                item = item.merged_into(earlier)
            self._items.append(item)
            self._positions += len(item.positions)
            self.added += new_positions
            while self._positions > self.capacity and len(self._items) > 1:
                old = self._items.popleft()
                self._positions -= len(old.positions)
                self.evicted += len(old.positions)
                if self.on_evict is not None:
                    self.on_evict(old)

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
