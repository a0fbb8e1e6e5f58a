"""`osd bench calibration`: how repeatable the startup calibration is, the costs every k decision reads.

A server measures at startup what a target pass costs by rows (engine.calibrate: each row count 1..k_max + 1 and the
kernel's pass bend fed after the same prefix, in interleaved rounds, the fastest round kept; the larger counts up to a
full step apart), and the scheduler's goodput allocation prices every extra proposal row from that curve: a row priced
7 ms instead of 2 refuses proposals that pay. This builds one server's engine (the bundled target and draft,
`max_batch` sequences), calibrates it `times` times with each number of timed rounds asked (alternating, so a slow
spell of the machine falls on every setting alike), and reports per row count the range of the cost against one row,
and each calibration's error against the best estimate from all of them (the fastest time seen at each count: timing
noise only ever slows a pass).
"""
from __future__ import annotations

import statistics

from tqdm import tqdm

MOST_ROWS = 17  # row counts reported: a step's decode rows, up to one past two of the Q4 kernel's passes of 8


def run_calibration(times: int = 5, repeats: tuple[int, ...] = (2, 6), max_batch: int = 8, threads: int = 2) -> dict:
    from osd.build import build_system
    from osd.config import ModelConfig, SpeculationConfig

    system = build_system(ModelConfig(threads=threads), SpeculationConfig.serving(max_batch=max_batch))
    engine = system.engine
    runs: dict[int, list[dict[int, float]]] = {r: [] for r in repeats}
    for _ in tqdm(range(times), desc="bench calibration", unit="round"):
        for r in repeats:
            cal = engine.calibrate(repeats=r)
            runs[r].append({int(n): t for n, t in (cal["row_seconds"] or {}).items()})
    return {"config": {"times": times, "repeats": list(repeats), "max_batch": engine.scheduler.capacity,
                       "k_max": engine.k_max, "threads": threads, "target": system.models.target,
                       "draft": system.models.draft},
            **calibration_spread(runs)}


def calibration_spread(runs: dict[int, list[dict[int, float]]]) -> dict:
    """{repeats: [row_seconds of one calibration]} -> per setting and row count (up to MOST_ROWS) the range of the cost
    against one row, and each calibration's |error| against the best estimate (each count's fastest time seen in any
    calibration, over the fastest one-row time)."""
    counts = sorted({n for rs in runs.values() for run in rs for n in run if n <= MOST_ROWS})
    best = {n: min(run[n] for rs in runs.values() for run in rs if n in run) for n in counts}
    reference = {n: best[n] / best[1] for n in counts}
    settings = {}
    for r, rs in runs.items():
        by_rows, errors = {}, []
        for n in counts:
            ratios = [run[n] / run[1] for run in rs if n in run]
            by_rows[str(n)] = {"vs_one_row_min": min(ratios), "vs_one_row_median": statistics.median(ratios),
                               "vs_one_row_max": max(ratios)}
            errors += [abs(x - reference[n]) / reference[n] for x in ratios] if n > 1 else []
        settings[str(r)] = {"timed_rounds": r + 1, "by_rows": by_rows,
                            "mean_abs_error_vs_reference": statistics.mean(errors) if errors else 0.0,
                            "max_abs_error_vs_reference": max(errors, default=0.0),
                            "runs": [{str(n): t for n, t in run.items()} for run in rs]}
    return {"reference_vs_one_row": {str(n): v for n, v in reference.items()}, "settings": settings}
