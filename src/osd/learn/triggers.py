"""When to update the draft (PAPER.md section 4): every I requests, buffer size >= S, or age >= T; and how far apart
updates are spaced while they stop paying (`Pace`)."""
from __future__ import annotations

from dataclasses import dataclass

from osd.learn.guard import flips_z
from osd.speed_model import expected_speedup


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
    and stays between; within [1, max_factor]. It also doubles when the speed the last updates bought does not pay
    for their work (`learning_pays`), however significant their held-out gain. `reset` (the drift guard restored a
    version: the traffic moved) brings it back to 1 and forgets the window.

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
        no held-out measure, the pace stays; pays: whether the speed the last updates' held-out gain buys covers
        their work, `learning_pays`; False doubles the factor whatever the held-out z says) -> the factor now."""
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


def speed_at(agreement: float, draft_cost: float = 0.04, row_cost: float = 0.06, k_max: int = 4) -> float:
    """Speculation's speed over the target alone at the draft's greedy agreement (PAPER.md section 2, i.i.d.
    acceptance): the best k's expected tokens a step over its cost, k draft tokens at `draft_cost` of a one-row target
    pass each and k more rows verified at `row_cost` each (the bundled Q4 target's calibration on the Xeon and on Zen 4:
    a draft token 1.3-1.9 ms against a one-row pass of 48-53 ms, each row to 7 +5-7% of it; k = 0 is the target alone)."""
    return max(expected_speedup(agreement, k, draft_cost, 1.0 + k * row_cost) for k in range(k_max + 1))


def learning_pays(agreement_before: float | None, agreement_now: float | None, work_seconds: float,
                  horizon_seconds: float, speculable: float = 1.0) -> bool | None:
    """Whether the learner's last updates paid for their work, amortised: the speed their held-out agreement gain
    buys (`speed_at`, now over before, less 1: a share of serving time saved) over the next `horizon_seconds` of
    serving, against the seconds they took. None while either agreement is unknown.

    Marginal and amortised, because an update's work is paid once and what it bought serves from then on. The rule it
    replaces judged the gain so far (the serving version's tokens per live step over the first version's) against the
    learner's share of the recent wall time: on code (Intel, 600 requests at 0.5 of capacity) it doubled the interval
    three times by request ~150 while held-out agreement still rose 0.32 -> 0.53 (a live step's tokens also follow the
    load, so that gain read 0.96-1.22x between neighbouring stats lines), and went on paying for updates whose
    agreement had stopped rising as soon as the gain so far exceeded the share
    (benchmarks/live/bench-live-code600-load05-il25-vocabswap-intel.json). Here the first updates on code (agreement
    0.30 -> 0.45: +17% speed) pay for their ~28 s many times over 600 s, chat's (0.21 -> 0.25: +3%) do not, and
    neither do updates that move agreement by a point at 0.5 (+2%).

    speculable: the share of the server's decoding seconds spent in passes where a sequence may propose (the
    scheduler proposes nothing beside prompt rows, schedule/scheduler.py), so the only share a better draft speeds
    up: chat's long prompts fill many passes with prompt chunks (Zen 4, 0.5 of capacity: 5.4 of 8.3 rows a pass),
    where agreement buys nothing."""
    value = learning_value(agreement_before, agreement_now, work_seconds, horizon_seconds, speculable)
    return None if value is None else value["pays"]


def learning_value(agreement_before: float | None, agreement_now: float | None, work_seconds: float,
                   horizon_seconds: float, speculable: float = 1.0) -> dict | None:
    """What `learning_pays` weighs, for the update's log line and report: the agreements, the speed gain where the
    server speculates and over all its decoding (a share: that gain times `speculable`), the serving seconds it saves
    over the horizon, the work it took, and whether the one covers the other ("pays"). None while either agreement
    is unknown."""
    if agreement_before is None or agreement_now is None:
        return None
    speculating_gain = speed_at(agreement_now) / speed_at(agreement_before) - 1.0
    gain = speculable * speculating_gain
    return {"agreement_before": agreement_before, "agreement_now": agreement_now,
            "speculating_gain": speculating_gain, "speculable": speculable, "speed_gain": gain,
            "saved_seconds": gain * horizon_seconds, "work_seconds": work_seconds, "horizon_seconds": horizon_seconds,
            "pays": gain * horizon_seconds >= work_seconds}


def update_outcome(report: dict) -> dict:
    """What the pace weighs of one update's report: its work seconds, the serving version's held-out greedy
    agreement after it (the candidate's if published, else the version that kept serving; None without held-out
    positions), and the agreement it changed (its held-out flips over the positions; 0 unless published)."""
    key = "holdout_after" if report.get("published") else "holdout_before"
    measured = report.get(key) or {}
    flips, positions = report.get("heldout_flips"), measured.get("positions") or 0
    gained = (flips[0] - flips[1]) / positions if report.get("published") and flips and positions else 0.0
    return {"work": sum(report.get("work_seconds", {}).values()), "agreement": measured.get("greedy_agreement"),
            "gained": gained}


def describe_value(value: dict | None) -> str:
    """The update log line's verdict on the last updates (`learning_value` above)."""
    if value is None:
        return "not judged"
    where = "" if value["speculable"] >= 1.0 else \
        f" where it speculates, {value['speculable']:.2f} of decoding: {100 * value['speed_gain']:+.1f}%"
    return (f"{'yes' if value['pays'] else 'no'} (held-out agreement {value['agreement_before']:.3f} -> "
            f"{value['agreement_now']:.3f}: {100 * value['speculating_gain']:+.1f}% speed"
            f"{where}, {value['saved_seconds']:.0f} s "
            f"saved over {value['horizon_seconds']:.0f} s against {value['work_seconds']:.0f} s of work)")
