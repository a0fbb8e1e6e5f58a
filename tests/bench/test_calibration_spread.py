"""osd bench calibration's summary: both estimators over the same rounds, their ranges across calibrations."""
import pytest

from osd_bench.calibration import calibration_spread


def test_round_ratios_hold_where_the_machine_speed_drifts_between_rounds():
    steady = [{1: 50.0, 8: 70.0}, {1: 50.0, 8: 70.0}, {1: 50.0, 8: 70.0}]
    drifting = [{1: 40.0, 8: 70.0}, {1: 55.0, 8: 62.0}, {1: 50.0, 8: 70.0}]  # a fast one row, a fast 8 rows apart
    out = calibration_spread([steady, drifting])["estimators"]
    apart, ratios = out["fastest_apart"]["by_rows"]["8"], out["round_ratios"]["by_rows"]["8"]
    assert (apart["min"], apart["max"]) == (pytest.approx(1.4), pytest.approx(1.55))
    assert (ratios["min"], ratios["max"]) == (pytest.approx(1.4), pytest.approx(1.4))
    assert out["round_ratios"]["mean_spread"] == pytest.approx(0.0)
    assert out["fastest_apart"]["mean_spread"] == pytest.approx(0.15)
