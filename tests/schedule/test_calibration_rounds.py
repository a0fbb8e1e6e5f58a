"""Startup calibration: the row counts near a pass's bend are timed in the same interleaved rounds (engine.calibrate)."""
from conftest import tiny_qwen2
from test_scheduler import engine_over


class TimedFeeds:
    """Wraps the target's feed: a fake clock advances by a cost of the rows fed, slower in chosen rounds of a count."""

    def __init__(self, engine, slow: dict[int, set[int]]):
        self.engine, self.slow, self.now, self.fed = engine, slow, 0.0, []
        self.inner = engine.target.feed
        engine.target.feed = self.feed
        engine.clock = lambda: self.now

    def feed(self, tokens, *args, **kwargs):
        n = len(tokens)
        self.fed.append(n)
        seen = self.fed.count(n) - 1  # this count's earlier feeds in this calibration
        self.now += 1.0 + 0.1 * n + (5.0 if seen in self.slow.get(n, set()) else 0.0)
        return self.inner(tokens, *args, **kwargs)


def test_pass_bend_is_timed_in_the_rounds_and_the_fastest_round_kept():
    engine, _ = engine_over(tiny_qwen2(seed=0), tiny_qwen2(seed=1, layers=1), k=3, adaptive=True, max_batch=4)
    engine.target.rows_per_pass = 6  # a kernel that runs rows in passes of 6: the curve bends at 6 -> 7
    timed = TimedFeeds(engine, slow={7: {1, 2}, 2: {3}})  # count 7 slow in its first two timed rounds, 2 in its third
    calibration = engine.calibrate(context_len=16, repeats=3)
    near = [1, 2, 3, 4, 6, 7]  # 1..k_max + 1, then the pass and one row past it
    assert timed.fed[1 : 1 + 5 * len(near)] == near * 5  # (after the prefix) a warm-up round, then 4 timed ones
    rows = calibration["row_seconds"]
    for n in near:  # the fastest timed round, whichever rounds were slow
        assert abs(rows[n] - (1.0 + 0.1 * n)) < 1e-9
    assert calibration["t_target"] == [rows[n] for n in (1, 2, 3, 4)]
    later = timed.fed[1 + 5 * len(near):]  # the larger counts: _row_seconds' prefix, then each count's passes
    assert later[1:] and not set(later[1:]) & set(near)  # none of the counts the rounds timed is timed again apart
