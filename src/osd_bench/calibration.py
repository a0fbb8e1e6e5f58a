"""`osd bench calibration`: how repeatable the startup calibration is, the costs every k decision reads.

A server measures at startup what a target pass costs by rows (engine.calibrate: each row count 1..k_max + 1 and the
kernel's pass bend fed after the same prefix, in interleaved rounds), and the scheduler's goodput allocation prices
every extra proposal row from that curve: a row priced 7 ms instead of 2 refuses proposals that pay. This builds one
server's engine (the bundled target and draft, `max_batch` sequences), calibrates it `times` times, and reads each
calibration's timed rounds two ways: the fastest time of each count taken apart (the estimator before), and each
count against its own round's one row, the median over rounds (`speed_model.curve_from_rounds`, the one serving uses).
Reported per row count: the range over calibrations of the cost against one row, each estimator's.
"""
from __future__ import annotations

import statistics

from tqdm import tqdm

from osd.speed_model import curve_from_rounds

ESTIMATORS = {"fastest_apart": lambda rounds: {n: min(r[n] for r in rounds) for n in rounds[0]},
              "round_ratios": curve_from_rounds}


def run_calibration(times: int = 6, repeats: int = 6, max_batch: int = 8, threads: int = 2) -> dict:
    from osd.build import build_system
    from osd.config import ModelConfig, SpeculationConfig

    system = build_system(ModelConfig(threads=threads), SpeculationConfig.serving(max_batch=max_batch))
    engine = system.engine
    calibrations = [engine.calibrate(repeats=repeats)["rounds"]
                    for _ in tqdm(range(times), desc="bench calibration", unit="calibration")]
    return {"config": {"times": times, "repeats": repeats, "timed_rounds": repeats + 1,
                       "max_batch": engine.scheduler.capacity, "k_max": engine.k_max, "threads": threads,
                       "target": system.models.target, "draft": system.models.draft},
            **calibration_spread(calibrations),
            "one_row_ms": [1e3 * min(r[1] for r in rounds) for rounds in calibrations],
            "rounds": [[{str(n): t for n, t in r.items()} for r in rounds] for rounds in calibrations]}


def calibration_spread(calibrations: list[list[dict[int, float]]]) -> dict:
    """Each calibration's timed rounds ({rows: seconds} each) -> per estimator and row count, the range and median
    over calibrations of the cost against one row, and the mean spread (max - min) over the counts."""
    out = {}
    for name, estimate in ESTIMATORS.items():
        curves = [estimate(rounds) for rounds in calibrations]
        by_rows = {}
        for n in sorted(curves[0]):
            ratios = [c[n] / c[1] for c in curves]
            by_rows[str(n)] = {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}
        out[name] = {"by_rows": by_rows,
                     "mean_spread": statistics.mean(r["max"] - r["min"] for n, r in by_rows.items() if n != "1")}
    return {"estimators": out}
