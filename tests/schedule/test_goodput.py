"""The goodput allocation (schedule/goodput.py): pure functions on known costs."""
import pytest

from osd.schedule.goodput import RowCosts, allocate_k, amortized_catch_up, goodput, non_decreasing
from osd.speed_model import expected_tokens


def q4_like(rows: int) -> float:
    """A pass that is memory-bound: 8 rows cost 1.7x one, then each further row its share (osd bench rows)."""
    return 1.0 + 0.1 * (min(rows, 8) - 1) + 0.2 * max(0, rows - 8)


def saturated(rows: int) -> float:
    """A machine with no room left: every row costs its full share."""
    return float(rows)


def test_a_lone_sequence_speculates_where_rows_are_cheap_and_the_draft_accepts():
    assert allocate_k([0.8], [0.02], [6], q4_like) == [max(range(7), key=lambda k: expected_tokens(0.8, k) / (q4_like(k + 1) + 0.02 * k))]
    assert allocate_k([0.8], [0.02], [6], q4_like)[0] >= 3


def test_speculation_backs_off_to_k_zero_when_the_step_cost_grows_with_rows():
    assert allocate_k([0.6] * 8, [0.0] * 8, [6] * 8, saturated) == [0] * 8
    assert allocate_k([0.6] * 8, [0.05] * 8, [6] * 8, saturated) == [0] * 8


def test_under_load_the_better_accepting_sequences_get_the_rows():
    ks = allocate_k([0.9, 0.2, 0.9, 0.2], [0.0] * 4, [6] * 4, q4_like)
    assert ks[0] > ks[1] and ks[2] > ks[3] and ks[1] == ks[3] == 0


def test_a_cap_is_never_exceeded_and_the_result_is_a_local_optimum():
    alphas, costs, caps = [0.95, 0.7, 0.5], [0.01, 0.0, 0.02], [2, 6, 1]
    ks = allocate_k(alphas, costs, caps, q4_like)
    assert all(0 <= k <= c for k, c in zip(ks, caps))
    best = goodput(alphas, ks, costs, q4_like)
    for i in range(3):
        for d in (-1, 1):
            other = list(ks)
            other[i] += d
            if 0 <= other[i] <= caps[i]:
                assert goodput(alphas, other, costs, q4_like) <= best + 1e-12


def test_a_k_two_that_pays_is_found_past_a_k_one_that_does_not():
    # rows come in pairs of cost: 1 and 2 rows cost the same, 3 rows far more; the draft costs nothing
    steps = lambda rows: {1: 1.0, 2: 2.0, 3: 2.0}.get(rows, float(rows))
    assert allocate_k([0.9], [0.0], [2], steps) == [2]


def test_a_draft_whose_cache_lags_pays_its_catch_up_before_it_proposes():
    """Two sequences alike but for their draft caches: one in step, one 150 tokens behind (a prompt admitted without
    the draft's prefill). The catch-up (here 150 x 0.005 of a one-row pass) is charged once to a sequence that
    proposes at all, so only the one in step speculates; without the charge both would."""
    alphas, per_token, caps = [0.8, 0.8], [0.02, 0.02], [6, 6]
    assert allocate_k(alphas, per_token, caps, q4_like) == allocate_k(alphas, per_token, caps, q4_like, [0.0, 0.0])
    both = allocate_k(alphas, per_token, caps, q4_like)
    assert both[0] > 0 and both[1] > 0
    ks = allocate_k(alphas, per_token, caps, q4_like, [0.0, 150 * 0.005])
    assert ks[0] > 0 and ks[1] == 0
    assert goodput(alphas, [2, 0], per_token, q4_like, [0.0, 0.75]) == goodput(alphas, [2, 0], per_token, q4_like)
    assert goodput(alphas, [2, 1], per_token, q4_like, [0.0, 0.75]) < goodput(alphas, [2, 1], per_token, q4_like)


def test_a_catch_up_is_charged_as_its_share_of_the_steps_left():
    """Paid once, a catch-up serves every step the sequence has left: 0.75 of a one-row pass, 60 tokens to go at
    alpha 0.5 (1.5 tokens a step at k = 1) -> 40 steps, 0.01875 a step, which the lagging sequence's proposals
    repay; with 2 tokens to go it is charged whole and they do not."""
    assert amortized_catch_up(0.75, 60, 0.5) == pytest.approx(0.75 / 40)
    assert amortized_catch_up(0.75, 1, 0.5) == 0.75 and amortized_catch_up(0.0, 60, 0.5) == 0.0
    alphas, per_token, caps = [0.8, 0.8], [0.02, 0.02], [6, 6]
    assert allocate_k(alphas, per_token, caps, q4_like, [0.0, amortized_catch_up(0.75, 60, 0.8)])[1] > 0
    assert allocate_k(alphas, per_token, caps, q4_like, [0.0, amortized_catch_up(0.75, 2, 0.8)])[1] == 0


def test_row_costs_interpolate_between_and_extrapolate_beyond_what_was_measured():
    costs = RowCosts()
    assert costs(4) == 4.0  # nothing measured: proportional
    costs.calibrate({1: 1.0, 8: 1.7, 64: 6.0})
    assert costs(8) == 1.7 and costs(4) == pytest.approx(1.0 + 0.7 * 3 / 7)
    assert costs(128) == pytest.approx(6.0 + (6.0 - 1.7) / 56 * 64)
    costs.observe(8, 2.7)
    assert costs(8) == pytest.approx(0.8 * 1.7 + 0.2 * 2.7)


def test_row_costs_never_fall_with_more_rows():
    """A count measured cheap by chance (16 rows faster than 13, as seen under load) must not make the rows up to
    it look free: the curve read is the least-squares non-decreasing fit of the measured EMAs."""
    # the EMAs (ms) of one run at 8 clients (rows 8-16: 8 decoding sequences, their proposals, prompt chunks)
    seen = {8: 95.3, 9: 93.0, 10: 106.4, 11: 139.1, 12: 129.0, 13: 159.7, 14: 141.5, 15: 146.4, 16: 108.1, 24: 159.4}
    costs = RowCosts()
    costs.calibrate(seen)
    curve = [costs(r) for r in range(8, 25)]
    assert all(b >= a for a, b in zip(curve, curve[1:]))
    assert costs(8) == costs(9) == pytest.approx((95.3 + 93.0) / 2)  # a violating pair is pooled
    assert costs(16) == pytest.approx((159.7 + 141.5 + 146.4 + 108.1) / 4)  # so is a falling run
    assert costs(24) == 159.4


def test_non_decreasing_is_the_pool_adjacent_violators_fit():
    assert non_decreasing([]) == []
    assert non_decreasing([(1, 1.0), (2, 3.0), (3, 2.0), (4, 5.0)]) == [(1, 1.0), (2, 2.5), (3, 2.5), (4, 5.0)]
    assert non_decreasing([(1, 3.0), (2, 2.0), (3, 1.0)]) == [(1, 2.0), (2, 2.0), (3, 2.0)]
    assert non_decreasing([(1, 1.0), (5, 2.0)]) == [(1, 1.0), (5, 2.0)]
