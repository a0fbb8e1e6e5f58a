"""osd bench calibration's summary: ranges and errors against the best estimate (timing noise only slows)."""
import pytest

from osd_bench.calibration import calibration_spread


def test_spread_against_the_fastest_time_seen():
    runs = {2: [{1: 10.0, 2: 12.0, 8: 14.0, 40: 99.0}, {1: 10.0, 2: 15.0, 8: 14.0}],
            6: [{1: 11.0, 2: 13.2, 8: 15.4}, {1: 10.0, 2: 12.0, 8: 14.0}]}
    out = calibration_spread(runs)
    assert out["reference_vs_one_row"] == {"1": 1.0, "2": 1.2, "8": pytest.approx(1.4)}  # 40 rows: past MOST_ROWS
    few, many = out["settings"]["2"], out["settings"]["6"]
    assert few["timed_rounds"] == 3 and many["timed_rounds"] == 7
    assert few["by_rows"]["2"]["vs_one_row_min"] == 1.2 and few["by_rows"]["2"]["vs_one_row_max"] == 1.5
    assert few["max_abs_error_vs_reference"] == pytest.approx(0.25)  # 1.5 against 1.2
    assert few["mean_abs_error_vs_reference"] == pytest.approx(0.25 / 4)
    assert many["max_abs_error_vs_reference"] == pytest.approx(0.0)  # ratios exact though every time was slower
