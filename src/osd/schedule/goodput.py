"""Speculation that knows the load (SmartSpec): per step, each sequence's k chosen to maximise goodput.

goodput = expected tokens emitted by the step / the step's seconds
        = sum_i E(alpha_i, k_i) / (t_target(rows) + sum_i [k_i * t_draft_i + (k_i > 0) * catch_up_i]),
rows = sum_i (k_i + 1); catch_up_i: what sequence i's draft must feed first (a prompt admitted without the draft's
prefill, tokens committed while it did not propose), ~0.5 ms a token for the cheap draft on the AMD machine, so a
sequence 150 tokens behind pays ~75 ms, a whole step at 4 clients, before its first proposal. That feed is paid once
and buys proposals for every step the sequence has left, so a step is charged its share (`amortized_catch_up`):
charged whole to the one step, a request admitted beside others (no draft prefill) almost never proposed (code at
0.5 of capacity, Zen 4: 32 of 113 requests that arrived beside 3+ others proposed nothing in 64 tokens, and a draft
learnt to 0.39 acceptance decoded them at 18.1 tokens/s against 18.0 for the shipped one at 0.23,
benchmarks/archive/live/bench-live-ceiling-code300-load05-nolookup-ac89ec1.json); charged its share, 15 of 109
proposed nothing and the learnt draft decoded them at 21.5 against 20.1
(benchmarks/live/bench-live-ceiling-code300-load05-nolookup.json). What still holds speculation back under load is
the pass's cost past 4 rows, not the catch-up.
E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) (speed_model.expected_tokens); t_target(rows) is the cost of one
target pass over that many rows of the step's sequences (RowCosts: a curve by rows, plus what the sequences and the
contexts they attend to add, at the machine's measured speed). On osd's Q4 kernel a pass over 8 rows costs
~1.7x one row, so while the machine has room, proposals are almost free; when the pass is saturated each row costs
its full share and speculation backs off (k = 0) where a sequence's acceptance does not pay for its rows.
"""
from __future__ import annotations

import bisect
import math
from typing import Callable

from osd.speed_model import expected_tokens


Chance = float | list[float]  # a sequence's acceptance alpha, or its drafted proposal's chain (below)


def tokens_of(chance: Chance, k: int) -> float:
    """Expected tokens a sequence emits verifying k proposals: E(alpha, k) for an acceptance alpha, or for a proposal
    drafted already 1 + sum(chain[:k]), chain[d] being the chance its first d + 1 tokens are all accepted
    (schedule/confidence.py: each token's chance read from the draft's confidence in it)."""
    return 1.0 + sum(chance[:k]) if isinstance(chance, (list, tuple)) else expected_tokens(chance, k)


def goodput(alphas: list[Chance], ks: list[int], draft_seconds: list[float], step_seconds: Callable[[int], float],
            catch_up_seconds: list[float] | None = None) -> float:
    """Expected tokens per second of one step in which sequence i verifies k_i proposals (catch_up_seconds: what
    sequence i's draft feeds before it can propose at all, paid once if k_i > 0; a drafted chain's draft seconds: 0,
    spent already)."""
    rows = sum(k + 1 for k in ks)
    seconds = step_seconds(rows) + sum(k * t for k, t in zip(ks, draft_seconds))
    if catch_up_seconds is not None:
        seconds += sum(c for k, c in zip(ks, catch_up_seconds) if k)
    return sum(tokens_of(a, k) for a, k in zip(alphas, ks)) / seconds


def allocate_k(alphas: list[Chance], draft_seconds: list[float], caps: list[int], step_seconds: Callable[[int], float],
               catch_up_seconds: list[float] | None = None) -> list[int]:
    """Each sequence's k (0..cap) for the largest goodput: greedy ascent from all-zero, one proposal at a time to
    the sequence whose extra proposal raises goodput most (a run of two is tried too, so a k = 1 that does not pay
    alone cannot hide a k = 2 that does); stops when no extra proposal raises it."""
    ks = [0] * len(alphas)
    best = goodput(alphas, ks, draft_seconds, step_seconds, catch_up_seconds)
    while True:
        choice, choice_rate = None, best
        for i, cap in enumerate(caps):
            for step in (1, 2):
                if ks[i] + step > cap:
                    break
                ks[i] += step
                rate = goodput(alphas, ks, draft_seconds, step_seconds, catch_up_seconds)
                ks[i] -= step
                if rate > choice_rate * (1 + 1e-9):
                    choice, choice_rate = (i, step), rate
        if choice is None:
            return ks
        ks[choice[0]] += choice[1]
        best = choice_rate


def amortized_catch_up(seconds: float, remaining: int, alpha: float) -> float:
    """A lagging draft's catch-up feed as one step's share: paid once, it serves the steps the sequence has left,
    about remaining / E(alpha, 1) of them (at least one: a sequence near its end pays it whole)."""
    return seconds / max(1.0, remaining / expected_tokens(alpha, 1))


class RowCosts:
    """Seconds of one target pass of decoding rows: a curve by rows, plus what the rows' sequences add, times the
    machine's speed now.

        seconds(rows | contexts) = scale * (curve(rows) + per_sequence * (n - 1)
                                            + per_sequence_context * (sum(contexts) - base_context)
                                            + per_row_context * rows * (mean(contexts) - base_context))

    `curve` is calibrated on one sequence whose rows attend to `base_context` cached tokens (read through its
    least-squares non-decreasing fit, so more rows never cost less); the three terms are fitted at startup from
    passes of several sequences at a long context (`fit_pass_model`): each sequence's attention reads its own cache
    once (per_sequence_context) and each row does its own dot products over it (per_row_context). `scale` is an EMA
    of observed / modelled seconds of the passes the server runs. A grid of passes on the bundled 1.5B (Intel, 2
    threads, benchmarks/kernel/bench-passes-intel.json): 8 rows cost 68.4 ms as one sequence at 64 cached tokens,
    84.0 ms at 500, and 97.9 ms as 8 sequences at 500; the model misses the grid's passes by 1.9% on average, rows
    alone by 9.9%.

    The model replaces EMAs of live passes kept by rows alone: a count seen live (5 rows: 5 sequences at ~500 cached
    tokens, ~80 ms) beside counts never seen live, left at their calibration (7 rows: one sequence at 56 tokens,
    62 ms), was pooled by the non-decreasing fit into a flat stretch, so the allocation read the rows up to 7 as
    free and verified rows that did not pay (code at 0.5 of capacity, Intel: passes of 7.3 rows at 113.6 ms against
    5.3 at 89.8 ms, where the calibration said 6% apart)."""

    def __init__(self, ema: float = 0.9):
        self.ema = ema
        self.seconds: dict[int, float] = {}  # the calibrated curve by rows (one sequence at base_context)
        self.per_sequence = self.per_sequence_context = self.per_row_context = 0.0
        self.base_context = 0
        self.scale = 1.0
        self._fitted: tuple[list[int], list[float]] | None = None

    def calibrate(self, rows_seconds: dict[int, float], pass_model: dict | None = None) -> None:
        """rows_seconds: the one-sequence curve; pass_model: `fit_pass_model`'s terms (absent: rows alone)."""
        self.seconds = {int(r): float(t) for r, t in rows_seconds.items() if math.isfinite(t)}
        model = pass_model or {}
        self.per_sequence = float(model.get("per_sequence", 0.0))
        self.per_sequence_context = float(model.get("per_sequence_context", 0.0))
        self.per_row_context = float(model.get("per_row_context", 0.0))
        self.base_context = int(model.get("base_context", 0))
        self.scale = 1.0
        self._fitted = None

    def fitted(self) -> tuple[list[int], list[float]]:
        """(rows, seconds), by rows: the calibrated curve's non-decreasing fit."""
        if self._fitted is None:
            points = non_decreasing(sorted(self.seconds.items()))
            self._fitted = [r for r, _ in points], [t for _, t in points]
        return self._fitted

    @property
    def known(self) -> bool:
        return bool(self.seconds)

    def curve(self, rows: int) -> float:
        """The calibrated one-sequence seconds of `rows` (unscaled): linear between measured counts, extrapolated
        from the last two beyond them; nothing measured: proportional to rows (speculation never looks free)."""
        xs, ys = self.fitted()  # read many times a step (allocate_k): a bisection, no scan
        if not xs:
            return float(rows)
        if len(xs) == 1:
            return ys[0] * rows / xs[0]
        i = bisect.bisect_left(xs, rows)
        if i < len(xs) and xs[i] == rows:
            return ys[i]
        i = min(max(i, 1), len(xs) - 1)  # the segment around rows, or the first / last one to extrapolate
        (r0, t0), (r1, t1) = (xs[i - 1], ys[i - 1]), (xs[i], ys[i])
        return max(t0 + (t1 - t0) * (rows - r0) / (r1 - r0), 1e-9)

    def at(self, contexts: list[int]) -> Callable[[int], float]:
        """rows -> seconds of a pass whose rows belong to sequences with these cached lengths (one step's)."""
        terms = [getattr(self, term) for term in PASS_TERMS]  # the features are linear in rows: read at 0 and 1
        fixed, one = (sum(t * f for t, f in zip(terms, pass_features(contexts, rows, self.base_context)))
                      for rows in (0, 1))
        return lambda rows: self.scale * max(self.curve(rows) + fixed + (one - fixed) * rows, 1e-9)

    def __call__(self, rows: int) -> float:
        """Seconds of `rows` on one sequence at the calibration's context (scaled)."""
        return self.scale * self.curve(rows)

    def observe(self, rows: int, seconds: float, contexts: list[int]) -> None:
        """A pass of decoding rows timed: the scale follows observed / modelled."""
        if rows > 0 and contexts and math.isfinite(seconds) and seconds > 0:
            modelled = self.at(contexts)(rows) / self.scale
            self.scale = self.ema * self.scale + (1 - self.ema) * seconds / modelled


PASS_TERMS = ("per_sequence", "per_row_context", "per_sequence_context")


def pass_features(contexts: list[int], rows: int, base_context: int) -> list[float]:
    """What each of PASS_TERMS is multiplied by in a pass of `rows` rows over sequences with these cached lengths:
    the sequences beyond the first, each row's cached tokens beyond base_context (at the sequences' mean), the
    sequences' cached tokens beyond base_context each. No sequences: nothing."""
    n, total = len(contexts), sum(contexts)
    return [n - 1, rows * (total / n - base_context), total - base_context * n] if n else [0.0] * len(PASS_TERMS)


def fit_pass_model(passes: list[tuple[list[int], int, float]], curve: Callable[[int], float],
                   base_context: int) -> dict:
    """Timed passes [(the cached length of each sequence, rows, seconds)] -> RowCosts' terms: least squares of what
    the one-sequence curve leaves unexplained, each term >= 0 (a term fitted negative is dropped and the rest fitted
    again: more sequences or more context never make a pass cheaper)."""
    features = [pass_features(contexts, rows, base_context) for contexts, rows, _ in passes]
    residuals = [seconds - curve(rows) for _, rows, seconds in passes]
    kept = list(range(len(PASS_TERMS)))
    while True:
        coef = _least_squares([[f[j] for j in kept] for f in features], residuals) if kept else []
        negative = [j for j, c in zip(kept, coef) if c < 0]
        if not negative:
            break
        kept.remove(min(negative, key=lambda j: coef[kept.index(j)]))
    terms = dict.fromkeys(PASS_TERMS, 0.0)
    terms.update({PASS_TERMS[j]: float(c) for j, c in zip(kept, coef)})
    return {**terms, "base_context": int(base_context)}


def _least_squares(x: list[list[float]], y: list[float]) -> list[float]:
    import numpy as np

    coef, *_ = np.linalg.lstsq(np.array(x, dtype=float), np.array(y, dtype=float), rcond=None)
    return coef.tolist()


def non_decreasing(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(x, y) sorted by x -> the same xs with the least-squares non-decreasing fit of the ys (pool adjacent
    violators: a run that decreases is replaced by its mean)."""
    blocks: list[list[float]] = []  # [sum of ys, count] per pooled run
    for _, y in points:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    fitted = [total / n for total, n in blocks for _ in range(n)]
    return [(x, y) for (x, _), y in zip(points, fitted)]
