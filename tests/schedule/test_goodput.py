"""The goodput allocation (schedule/goodput.py): pure functions on known costs."""
import pytest

from osd.schedule.goodput import RowCosts, allocate_k, amortized_catch_up, fit_pass_model, goodput, non_decreasing
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


MODEL = {"per_sequence": 0.3, "per_sequence_context": 0.01, "per_row_context": 0.004, "base_context": 50}


def test_a_pass_costs_its_rows_plus_what_its_sequences_and_their_contexts_add():
    costs = RowCosts()
    costs.calibrate({1: 50.0, 8: 70.0, 16: 120.0}, MODEL)
    assert costs.at([50])(8) == pytest.approx(70.0)  # one sequence at the curve's own context: the curve
    # 4 sequences at 450 cached tokens, 8 rows: 3 more sequences, 4 caches of 450 read (1 of 50 in the curve), 8 rows
    # each attending to 400 more tokens
    assert costs.at([450] * 4)(8) == pytest.approx(70.0 + 3 * 0.3 + 0.01 * (1800 - 200) + 0.004 * 8 * 400)
    contexts = [300, 500, 400]  # a row's context: the step's mean
    assert costs.at(contexts)(9) - costs.at(contexts)(8) == pytest.approx(
        costs.curve(9) - costs.curve(8) + 0.004 * 350)


def test_the_scale_follows_the_machine_and_never_frees_rows_it_did_not_see():
    """Live passes move one scale (observed / modelled), for every row count alike. A count seen slow (5 rows of 5
    sequences at 500 tokens) must not make the counts beside it look free, as the EMAs by rows alone did, pooled by
    the non-decreasing fit with counts left at their one-sequence calibration."""
    costs = RowCosts(ema=0.5)
    costs.calibrate({1: 53.6, 5: 58.7, 7: 62.2, 8: 66.5, 16: 121.5}, MODEL)
    contexts = [500] * 5
    modelled = costs.at(contexts)(5)
    costs.observe(5, 2 * modelled, contexts)
    assert costs.scale == pytest.approx(1.5)
    assert costs.at(contexts)(5) == pytest.approx(1.5 * modelled)
    step = costs.at(contexts)
    assert step(7) - step(5) == pytest.approx(1.5 * (62.2 - 58.7 + 2 * 0.004 * 450))  # two rows more cost their share
    assert costs(8) == pytest.approx(1.5 * 66.5)
    for bad in (float("nan"), 0.0):
        costs.observe(5, bad, contexts)
    costs.observe(5, 99.0, [])
    assert costs.scale == pytest.approx(1.5)  # nothing learnt from a pass with no decoding rows or no time


def test_the_pass_model_is_fitted_back_from_passes_it_made():
    curve = RowCosts()
    curve.calibrate({1: 50.0, 2: 52.0, 8: 70.0})
    truth = RowCosts()
    truth.calibrate(curve.seconds, MODEL)
    shapes = [([450], 1), ([450], 8), ([450] * 4, 4), ([450] * 4, 8), ([50] * 4, 4), ([50] * 4, 8)]
    passes = [(c, rows, truth.at(c)(rows)) for c, rows in shapes]
    fitted = fit_pass_model(passes, curve.curve, 50)
    assert fitted == pytest.approx(MODEL)
    cheaper = [(c, rows, t - 0.5 * (len(c) - 1)) for c, rows, t in passes]  # sequences that make a pass cheaper
    fitted = fit_pass_model(cheaper, curve.curve, 50)
    assert fitted["per_sequence"] == 0.0 and fitted["per_row_context"] > 0 and fitted["per_sequence_context"] > 0


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
