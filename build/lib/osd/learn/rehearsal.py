"""Rehearsal: a uniform sample of older traffic, mixed into every training batch, so that learning the current
traffic does not erase what the draft learnt on earlier traffic (forgetting).

Measured without it (BENCHMARKS "sharp shift gsm8k -> spider -> code", cheap draft): after 100 code requests the
online draft was 0.103 *below* the never-trained control on held-out gsm8k, which it had learnt first. The replay
buffer is a FIFO of the last ~`capacity` positions, so after a shift every batch is new-domain only.

`Reservoir` keeps what the FIFO evicts, by reservoir sampling (Vitter's algorithm R over evicted items): at any
time it holds a uniform sample of all traffic older than the FIFO's window, whatever the stream's length, in
bounded memory. `mixed_batch` draws `share` of each batch from it and the rest from the FIFO.
Measured with share 0.5 on the same stream (BENCHMARKS "--rehearsal 0.5"): gsm8k held-out ends 0.043 *above* the
control, 0.016 below where its own segment left it; the newest domain gains a little less (code +0.203 vs +0.216).
Cost: no extra target forward (the items are verification's own), memory of `capacity` items (with their cached
trunk features when the draft trains its top layers only: ~0.7 MB per 384-token item on the 0.5B draft).
"""
from __future__ import annotations

import random
import threading

from osd.learn.buffer import ReplayItem


class Reservoir:
    """Thread-safe uniform sample of at most `capacity` items out of all items offered so far."""

    def __init__(self, capacity: int, seed: int = 0):
        self.capacity = capacity
        self.rng = random.Random(seed)
        self.offered = 0
        self._items: list[ReplayItem] = []
        self._lock = threading.Lock()

    def offer(self, item: ReplayItem) -> None:
        with self._lock:
            self.offered += 1
            if len(self._items) < self.capacity:
                self._items.append(item)
                return
            j = self.rng.randrange(self.offered)  # keep with probability capacity / offered
            if j < self.capacity:
                self._items[j] = item

    def snapshot(self) -> list[ReplayItem]:
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def state_dict(self) -> dict:
        """What a resumed run needs to continue as if never cut (bench/replay_state.py)."""
        with self._lock:
            return {"items": list(self._items), "offered": self.offered, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self._items, self.offered = list(state["items"]), state["offered"]
            self.rng.setstate(state["rng"])


class Sweeps:
    """Draws from a changing pool in shuffled sweeps: every item once before any twice (random reshuffling, as the
    epochs of offline training do), where independent batches let an item return in the very next step."""

    def __init__(self, rng: random.Random):
        self.rng, self._queue = rng, []

    def take(self, pool: list, n: int) -> list:
        """min(n, len(pool)) distinct items: the rest of the current sweep first (items that left the pool are
        dropped), then a new shuffled sweep of the pool as it is now (items that joined it wait for that)."""
        present = {id(item) for item in pool}
        self._queue = [item for item in self._queue if id(item) in present]
        out, chosen, again = [], set(), []
        while len(out) < min(n, len(pool)):
            if not self._queue:
                self._queue = list(pool)
                self.rng.shuffle(self._queue)
            item = self._queue.pop()
            if id(item) in chosen:  # already in this batch from the sweep before: it stays for this sweep
                again.append(item)
                continue
            out.append(item)
            chosen.add(id(item))
        self._queue.extend(again)
        return out


def history_share(evicted: int, recent: int, cap: float) -> float:
    """The older traffic's share of all traffic seen, at most `cap`: drawn with this share (stochastic=True below),
    a batch is a uniform sample over the whole history (each of the `evicted` older items as likely as each of the
    `recent` ones), as an offline draft trained on everything seen so far samples it."""
    total = evicted + recent
    return min(cap, evicted / total) if total else 0.0


def mixed_batch(rng: random.Random, recent: list, older: list, size: int, share: float,
                stochastic: bool = False, sweeps: tuple[Sweeps, Sweeps] | None = None) -> list:
    """A training batch of up to `size` items: round(size * share) drawn from `older` (as many as it holds), the
    rest from `recent`; without replacement within each. share = 0 or no older items: `recent` alone.
    stochastic: each slot is older with probability `share` (a binomial count), so that a share between two
    multiples of 1 / size is met on average rather than rounded. sweeps: (recent's, older's) draw each part in
    shuffled sweeps (Sweeps) instead of independently per batch."""
    n_old = sum(rng.random() < share for _ in range(size)) if stochastic else round(size * share)
    n_old = min(len(older), n_old)
    n_new = min(len(recent), size - n_old)
    if n_new < size - n_old:  # too few recent items: fill from the older ones
        n_old = min(len(older), size - n_new)
    if sweeps is not None:
        return sweeps[0].take(recent, n_new) + sweeps[1].take(older, n_old)
    return rng.sample(recent, n_new) + rng.sample(older, n_old)
