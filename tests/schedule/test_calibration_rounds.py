"""Startup calibration: the row counts near a pass's bend are timed in the same interleaved rounds, and each count's
cost is read against its own round's one row (engine.calibrate, speed_model.curve_from_rounds)."""
import pytest
from conftest import tiny_qwen2
from test_scheduler import engine_over

from osd.speed_model import curve_from_rounds

SPEEDS = [1.0, 1.0, 0.8, 1.3, 1.0, 0.9]  # the machine's speed in each round (round 0: the warm-up)


class TimedFeeds:
    """Wraps the target's feed: a fake clock advances by the rows' cost at the round's speed, plus a spell in chosen
    rounds of a count."""

    def __init__(self, engine, slow: dict[int, set[int]]):
        self.engine, self.slow, self.now, self.fed, self.round = engine, slow, 0.0, [], -1
        self.inner = engine.target.feed
        engine.target.feed = self.feed
        engine.clock = lambda: self.now

    def feed(self, tokens, *args, **kwargs):
        n = len(tokens)
        self.fed.append(n)
        self.round += n == 1  # every round starts with one row
        speed = SPEEDS[self.round] if 0 <= self.round < len(SPEEDS) else 1.0
        self.now += speed * (1.0 + 0.1 * n) + (5.0 if self.round - 1 in self.slow.get(n, set()) else 0.0)
        return self.inner(tokens, *args, **kwargs)


def test_pass_bend_is_timed_in_the_rounds_each_count_against_its_rounds_one_row():
    engine, _ = engine_over(tiny_qwen2(seed=0), tiny_qwen2(seed=1, layers=1), k=3, adaptive=True, max_batch=4)
    engine.target.rows_per_pass = 6  # a kernel that runs rows in passes of 6: the curve bends at 6 -> 7
    timed = TimedFeeds(engine, slow={7: {0, 1}, 2: {3}})  # count 7 slowed in two timed rounds, 2 in one
    calibration = engine.calibrate(context_len=16, repeats=4)
    near = [1, 2, 3, 4, 6, 7]  # 1..k_max + 1, then the pass and one row past it
    assert timed.fed[1 : 1 + 6 * len(near)] == near * 6  # (after the prefix) a warm-up round, then 5 timed ones
    rows = calibration["row_seconds"]
    for n in near:  # the fastest one row (the 0.8 round) times the ratio most rounds saw, whatever rounds were slow
        assert rows[n] == pytest.approx(0.8 * (1.0 + 0.1 * n))
    assert calibration["t_target"] == [rows[n] for n in (1, 2, 3, 4)]
    assert len(calibration["rounds"]) == 5 and calibration["rounds"][1][1] == pytest.approx(0.8 * 1.1)
    later = timed.fed[1 + 6 * len(near):]  # the larger counts: _row_seconds' prefix, then each count's passes
    assert later[1:] and not set(later[1:]) & set(near)  # none of the counts the rounds timed is timed again apart


def test_curve_from_rounds_reads_each_count_against_its_own_round():
    rounds = [{1: 50.0, 4: 60.0, 8: 70.0}, {1: 40.0, 4: 48.0, 8: 56.0}, {1: 60.0, 4: 72.0, 8: 99.0}]
    curve = curve_from_rounds(rounds)  # ratios 1.2 in every round at 4 rows; 1.4, 1.4, 1.65 at 8
    assert curve == {1: 40.0, 4: pytest.approx(48.0), 8: pytest.approx(56.0)}
    drifting = [{1: 40.0, 8: 70.0}, {1: 55.0, 8: 62.0}, {1: 50.0, 8: 70.0}]  # speed moved between rounds
    assert curve_from_rounds(drifting)[8] / 40.0 == pytest.approx(1.4)  # median of 1.75, 1.127, 1.4
    assert min(r[8] for r in drifting) / 40.0 == pytest.approx(1.55)  # fastest apart: a fast one row, another's 8
    assert curve_from_rounds([]) == {}
