"""When to update the draft (PAPER.md section 4): every I requests, buffer size >= S, or age >= T; and how far apart
updates are spaced while they stop paying (`Pace`)."""
from __future__ import annotations

from dataclasses import dataclass

from osd.learn.guard import flips_z


@dataclass
class UpdateTrigger:
    every_requests: int = 8  # I: update after this many finished requests (0 = off)
    min_positions: int = 0  # S: update when the buffer holds this many positions (0 = off)
    max_age_seconds: float = 0.0  # T: update when the oldest entry is this old (0 = off)
    min_positions_to_train: int = 1  # never update on fewer positions than this

    def due(self, requests_since_update: int, buffer_positions: int, oldest_age: float, factor: int = 1) -> str | None:
        """The reason an update is due now, or None (factor: I is multiplied by it, `Pace.factor`)."""
        if buffer_positions < max(1, self.min_positions_to_train):
            return None
        if self.every_requests and requests_since_update >= self.every_requests * factor:
            return "requests"
        if self.min_positions and buffer_positions >= self.min_positions:
            return "size"
        if self.max_age_seconds and oldest_age >= self.max_age_seconds:
            return "age"
        return None


class Pace:
    """Updates spaced out while they stop paying: the request interval's factor doubles when the last `window`
    published updates together did not raise held-out agreement (their held-out flips pooled, McNemar's z,
    guard.flips_z, <= `back_z`) or an update was rejected, halves when they did (z > `keep_z`),
    and stays between; within [1, max_factor]. It also doubles when learning's live gain does not pay for the
    learner's cores (`learning_pays`), however held-out agreement moves. `reset` (the drift guard restored a version: the traffic moved) brings
    it back to 1 and forgets the window.

    Pooled, not per update: one update of the serving recipe (8 steps of 2 items) moves held-out agreement by a few
    positions of ~400, within one update's noise, while 300 code requests of them lift it from 0.30 to 0.53
    (benchmarks/learning/replay-code-test300.json): a per-update test would back off while the draft still learns.
    On a stream the draft has learned what it can, the pooled z is noise around 0 and the factor climbs to
    max_factor: the learner then spends ~1/max_factor of its time. max_factor 1: a fixed pace. Limitation: a slow
    shift that neither the pooled z nor the drift guard sees is followed up to max_factor times more slowly."""

    def __init__(self, max_factor: int = 1, window: int = 4, back_z: float = 0.0, keep_z: float = 1.0):
        self.max_factor, self.window, self.back_z, self.keep_z = max_factor, window, back_z, keep_z
        self.factor = 1
        self.recent: list[tuple[int, int]] = []  # (gained, lost) of the last `window` published updates

    def after_update(self, published: bool, flips: tuple[int, int] | None, pays: bool | None = None) -> int:
        """One update's outcome (flips: its (gained, lost) on held-out positions against the serving draft; None:
        no held-out measure, the pace stays; pays: whether learning's live gain covers what the learner costs the
        server, `learning_pays`; False doubles the factor whatever held-out agreement says) -> the factor now."""
        if not published:
            self.factor = min(self.max_factor, 2 * self.factor)
            return self.factor
        if flips is not None:
            self.recent = (self.recent + [tuple(flips)])[-self.window:]
        if pays is False:
            self.factor = min(self.max_factor, 2 * self.factor)
            return self.factor
        if flips is None or len(self.recent) < self.window:
            return self.factor
        gained, lost = sum(g for g, _ in self.recent), sum(lo for _, lo in self.recent)
        z = flips_z(gained, lost)
        if z <= self.back_z:
            self.factor = min(self.max_factor, 2 * self.factor)
        elif z > self.keep_z:
            self.factor = max(1, self.factor // 2)
        return self.factor

    def reset(self) -> None:
        self.factor, self.recent = 1, []


def learning_pays(tokens_per_step_vs_first: float | None, learner_share: float | None) -> bool | None:
    """Whether learning pays for the cores it takes: the serving version's tokens per verification step over the
    first version's, less 1 (what learning bought each step; an upper bound on the speed it bought, since more
    accepted tokens also mean dearer passes), against the learner's share of the wall time. None while either is
    unknown. On chat (Intel, benchmarks/live/bench-live-chat300-load05-il25-intel-clean.json) tokens per step
    1.03-1.11 against 1.04-1.06 learning off, for 0.05-0.10 of the wall time: it does not; on code (0.5 of capacity)
    1.30-1.43 against 1.13-1.23 for 0.10-0.13: it does."""
    if tokens_per_step_vs_first is None or learner_share is None:
        return None
    return tokens_per_step_vs_first - 1.0 >= learner_share
