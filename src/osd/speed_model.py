"""The expected-speedup model of PAPER.md section 2, as pure functions, and the per-step k policy.

alpha: token acceptance rate; k: proposal length; t_draft: seconds per draft forward;
t_target(n): seconds for one target forward over n tokens (verification of k proposals is n = k+1).
"""
from __future__ import annotations

import math
import statistics

from osd.schedule.confidence import ConfidenceBins


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted per step (bonus included), i.i.d. acceptance: (1-a^(k+1))/(1-a)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Speedup over target-only decoding: E / (k*c + v), c = draft/target cost, v = verify cost."""
    return expected_tokens(alpha, k) / (k * c + v)


def best_k(alpha: float, t_draft: float, t_target: list[float], k_max: int) -> int:
    """k in 0..k_max maximising expected tokens per second; t_target[n-1] = time for n tokens."""
    def rate(k: int) -> float:
        return expected_tokens(alpha, k) / (k * t_draft + t_target[k])

    return max(range(k_max + 1), key=rate)


class TargetCosts:
    """EMAs of measured target-forward seconds by rows fed (t[n] = verifying n = k+1 rows), shared by the policies.

    Noise only ever slows a forward, so a timing faster than the estimate is taken at once and a slower one through
    the EMA (as the draft's cost is), and a row count's estimate is read no higher than that of any larger row count
    measured (`by_rows`): more rows never cost less, so the bound from more rows holds for fewer. Together they undo
    a calibration a busy spell of the machine inflated at the first live step: seen on Intel, a one-row time of
    0.207 s against ~0.05 s (a test run beside the calibration) made the whole 0.5B draft look cheap (c 0.34 instead
    of 1.22), and with the EMA alone the policy went on speculating with it for the whole run, decoding below the
    target alone (tests/test_policy_simulated.py; live, `osd bench speed --busy-calibration 6`: 0.70x the Q4 target
    alone before, 1.11x after, benchmarks/bench-speed-intel-busy6-calibration*.json)."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.seconds: list[float | None] = [None] * (k_max + 1)

    def calibrate(self, t_target: list[float]) -> None:
        self.seconds = list(t_target[: self.k_max + 1]) + [None] * max(0, self.k_max + 1 - len(t_target))

    def observe(self, k: int, seconds: float) -> None:
        if math.isfinite(seconds) and k <= self.k_max:
            old = self.seconds[k]
            self.seconds[k] = seconds if old is None or seconds < old else 0.8 * old + 0.2 * seconds

    def by_rows(self) -> list[float] | None:
        """t[k] for k = 0..k_max: each measured k bounded by the larger ones (`bounded_by_larger`), unmeasured k
        extrapolated linearly from the measured ones; None if none is."""
        known = bounded_by_larger([(n, t) for n, t in enumerate(self.seconds) if t is not None])
        if not known:
            return None
        n0, t0 = known[0]
        slope = (known[-1][1] - t0) / (known[-1][0] - n0) if len(known) > 1 else 0.25 * t0
        measured = dict(known)
        return [measured[n] if n in measured else t0 + slope * (n - n0) for n in range(self.k_max + 1)]


def bounded_by_larger(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(rows, seconds) sorted by rows -> each seconds lowered to the least seconds measured at as many rows or more.
    Timing noise is one-sided (a forward is only ever slowed), so the least-squares fit would keep half of a stale
    high value; the bound from a larger row count is a measurement."""
    bounded, least = [], math.inf
    for n, t in reversed(points):
        least = min(least, t)
        bounded.append((n, least))
    return bounded[::-1]


def curve_from_rounds(rounds: list[dict[int, float]]) -> dict[int, float]:
    """Seconds of a pass by rows from interleaved calibration rounds ({rows: seconds} each, every count timed once a
    round): each count's cost against the same round's one row, the median over rounds, times the fastest one-row
    time. The machine's speed drifts (a one-row pass 62-68 ms across six calibrations on the Intel VM, `osd bench
    calibration`), and the fastest time per count taken apart pairs a fast round's one row with another round's n
    rows; a round's ratio carries one speed, and the median drops the rounds a spell split. Measured, the two read the
    curve about as repeatably there (each count's range over the six, mean 0.09x of one row against 0.10x,
    benchmarks/kernel/bench-calibration-intel.json): the rest of the spread is the machine's."""
    if not rounds:
        return {}
    one = min(r[1] for r in rounds)
    counts = sorted({n for r in rounds for n in r})
    return {n: one * statistics.median(r[n] / r[1] for r in rounds if n in r) for n in counts}


class KPolicy:
    """Chooses k each step for one proposal source from its live acceptance estimate and measured costs.

    alpha is estimated by the truncated-geometric MLE accepted / (accepted + rejections), smoothed
    with an EMA; the draft cost is an EMA of single-token draft forwards; target costs are shared
    (`TargetCosts`). With adaptive=False it always returns k_max.
    Steps at k = 0 teach nothing about alpha or the draft's cost, so after `probe_every` such steps it tries
    k = 2 (every second probe k = 1, see below; k = 2's first draft forward catches up on every token committed
    without the draft; the second is a single-token forward, timed: the probe measures the cost again too). A probe
    costs more than a draft token, so the interval doubles after each probe that does not change the decision (up
    to `max_probe_every`) and returns to `probe_every` once speculation pays again: probing costs a bounded share
    of steps.
    Where speculation could not pay even with every token accepted (draft + verification dearer than the
    tokens they could yield), it probes only every `max_probe_every` steps: rarely, but a draft cost measured
    on a cold start or a busy machine cannot switch speculation off for good. A timing faster than the
    estimate is taken at once (noise only ever slows a forward), a slower one through the EMA.
    A new draft version (the online learner published one) may accept more than the old: the next step that would
    not speculate probes at once, and the interval starts again at `probe_every`.
    Near the break-even acceptance the estimate's noise decides: where speculation would pay at the estimate's
    upper bound (`upper_z` standard errors of the evidence the EMA holds, `alpha_upper`), k = 0 is not trusted
    enough to back off, and probes stay `probe_every` apart. With the EMA's ~10 tokens of evidence (ema 0.9) and
    no such bound, a draft at alpha 0.35-0.40 whose k = 1 pays 1.10-1.14x was switched off by a run of rejections
    and then probed ever more rarely: it realised 1.00-1.01x (simulated with costs measured here; seen live as
    whole draft versions served at k = 0). ema 0.98 with upper_z 1 realises 1.09x / 1.14x there and costs < 0.3%
    where speculation does not pay (tests/test_policy_simulated.py).
    Target costs are EMAs per row count, refreshed only by the k that is chosen: one slow measurement of the k that
    pays (a step timed while the learner trained beside it) made that k look dear, the policy settled on a worse
    neighbour and never measured the better k again (seen live: a draft at alpha 0.31 served at k = 2, where k = 1
    pays ~1.05x and k = 2 ~0.90x). So every `refresh_every`-th speculating step takes a neighbour of the best k
    instead (k - 1 and k + 1 in turn; k - 1 = 0 re-times target-only decoding): each neighbour's cost is re-measured
    every 2 * refresh_every steps, for at most 1 / refresh_every of the steps at a k the estimate ranks second.
    The same stale cost can make k = 0 look best: so every second probe is k = 1 (re-timing a 2-row verification),
    except where speculation never pays (there the probes re-time the draft, which needs k = 2). refresh_every = 0
    turns both off.
    A probe of a draft whose cache lags first feeds what it missed (`catch_up_seconds`, from the lag and the
    calibrated seconds per token): with the whole 0.5B drafting on the Q4 target, a draft that never paid, its forwards
    took 0.98-3.4 s of a 24-question run, almost all catch-up (bench-speed-intel-multilingual-depth-repeat.json,
    bench-speed-intel-probe-catch-up-before.json; 0.007 s with this rule, the speed within noise). Outside the
    noise band the interval is therefore at least what keeps a probe's catch-up within `probe_share` of the time spent
    at k = 0 since the last probe (k = 0 steps at the one-row cost). Within the noise band it is not stretched: there
    the draft may pay, and its catch-up is paid once, not per probe; nor is the probe of a new draft version.
    """

    def __init__(self, k_max: int, adaptive: bool = True, alpha_prior: float = 0.7, ema: float = 0.98, probe_every: int = 16,
                 costs: TargetCosts | None = None, max_probe_every: int = 512, upper_z: float = 1.0,
                 refresh_every: int = 16, probe_share: float = 0.02):
        self.k_max, self.adaptive, self.ema, self.upper_z = k_max, adaptive, ema, upper_z
        self.refresh_every, self._speculating_steps = refresh_every, 0
        self.probe_share, self._new_version = probe_share, False
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.accepted, self.rejected = alpha_prior * 10, (1 - alpha_prior) * 10  # prior worth ~10 tokens
        self.t_draft: float | None = None
        self.t_catch_up = 0.0  # seconds per token a lagging draft cache feeds before proposing (calibrated)
        self.costs = costs or TargetCosts(k_max)
        self._zero_steps, self._interval, self.probes = 0, probe_every, 0
        self.draft_version = None
        self.confidence = ConfidenceBins()  # acceptance by the draft's confidence in a token (schedule/confidence.py)

    @property
    def alpha(self) -> float:
        return self.accepted / max(self.accepted + self.rejected, 1e-9)

    @property
    def alpha_upper(self) -> float:
        """One-sided upper confidence bound of alpha (`upper_z` standard errors) from the evidence the EMA holds."""
        n = max(self.accepted + self.rejected, 1.0)
        a = self.alpha
        return min(1.0, a + self.upper_z * math.sqrt(max(a * (1 - a), 0.25 / n) / n))

    @property
    def t_target(self) -> list[float | None]:
        return self.costs.seconds

    def calibrate(self, t_draft: float, t_target: list[float] | None = None, t_catch_up: float = 0.0) -> None:
        self.t_draft, self.t_catch_up = t_draft, t_catch_up
        if t_target is not None:
            self.costs.calibrate(t_target)

    def _best(self, cap: int, alpha: float | None = None) -> int | None:
        costs = self.costs.by_rows()
        if costs is None or self.t_draft is None:
            return None
        return best_k(self.alpha if alpha is None else alpha, self.t_draft, costs[: cap + 1], cap)

    def would_speculate(self, cap: int) -> bool:
        """Whether k > 0 pays at the estimated acceptance and one-row costs (costs measured; nothing changes)."""
        return bool(self._best(cap))

    def could_pay(self) -> bool:
        """Whether speculation would pay at one-row costs if every token were accepted (costs measured)."""
        return bool(self._best(self.k_max, alpha=1.0))

    def on_draft_version(self, version) -> None:
        """The source's draft version at the start of a request (None: a source without versions)."""
        if version != self.draft_version and self.draft_version is not None:
            self._interval, self._zero_steps = self.probe_every, self.probe_every - 1  # probe at the next k = 0 step
            self._new_version = True  # ... whatever its catch-up costs
        self.draft_version = version

    def choose_k(self, remaining: int, catch_up_seconds: float = 0.0) -> int:
        """k for the next step; catch_up_seconds: what a proposal from this source would feed first (its lag)."""
        cap = max(0, min(self.k_max, remaining - 1))
        if not self.adaptive or cap == 0:
            return cap
        k = self._best(cap)
        if k is None:
            return cap
        if k > 0:
            self._zero_steps, self._interval = 0, self.probe_every
            return self._refresh_neighbour(k, cap)
        never_pays = self._best(cap, alpha=1.0) == 0  # not even if every token were accepted: probe rarely
        within_noise = not never_pays and self._best(cap, alpha=self.alpha_upper) > 0
        self._zero_steps += 1
        interval = self.max_probe_every if never_pays else self.probe_every if within_noise else self._interval
        if catch_up_seconds > 0 and not within_noise and not self._new_version:
            interval = max(interval, math.ceil(catch_up_seconds / (self.probe_share * self.costs.by_rows()[0])))
        if self._zero_steps >= interval:
            self._zero_steps, self._new_version = 0, False
            if not never_pays and not within_noise:
                self._interval = min(2 * self._interval, self.max_probe_every)
            self.probes += 1
            return min(1 if self.refresh_every and self.probes % 2 == 0 and not never_pays else 2, cap)
        return 0

    def _refresh_neighbour(self, k: int, cap: int) -> int:
        """k, or on every refresh_every-th speculating step its neighbour (k - 1 and k + 1 in turn; class docstring)."""
        self._speculating_steps += 1
        if not self.refresh_every or self._speculating_steps % self.refresh_every:
            return k
        neighbour = k + 1 if (self._speculating_steps // self.refresh_every) % 2 else k - 1
        return neighbour if 0 <= neighbour <= cap else k

    def observe(self, k: int, n_accepted: int, draft_forward_seconds: list[float], t_target: float | None = None) -> None:
        """draft_forward_seconds: timings of single-token draft forwards (catch-up forwards excluded)."""
        if k > 0:
            rejected = 1 if n_accepted < k else 0
            self.accepted = self.ema * self.accepted + n_accepted
            self.rejected = self.ema * self.rejected + rejected
        for t in draft_forward_seconds:  # faster: taken at once; slower: through the EMA (class docstring)
            self.t_draft = t if self.t_draft is None or t < self.t_draft else 0.8 * self.t_draft + 0.2 * t
        if t_target is not None:
            self.costs.observe(k, t_target)
