"""scripts/bench_scheduler.py's pooled view of a repeated level: tokens/s over all runs, and each run's ratio to the
target-only run beside it in the order."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _script():
    path = Path(__file__).parents[2] / "scripts" / "bench_scheduler.py"
    spec = importlib.util.spec_from_file_location("bench_scheduler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(arm, c, tokens, wall):
    return {"arm": arm, "concurrency": c, "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def test_a_repeated_level_is_pooled_and_paired_run_by_run():
    records = [_record("spec", 4, 100, 2.0), _record("target-only", 4, 100, 2.5),  # run 1: 50 against 40 tok/s
               _record("target-only", 4, 100, 4.0), _record("spec", 4, 100, 5.0),  # run 2, slow spell: 20 against 25
               _record("spec", 1, 50, 1.0), _record("target-only", 1, 50, 2.0)]  # a level run once: not pooled
    rows = {(p["arm"], p["concurrency"]): p for p in _script().pooled(records)}
    assert set(rows) == {("spec", 4), ("target-only", 4)}
    spec, alone = rows[("spec", 4)], rows[("target-only", 4)]
    assert spec["runs"] == 2 and spec["tokens_per_s"] == pytest.approx(200 / 7.0)  # all tokens over all seconds
    assert alone["tokens_per_s"] == pytest.approx(200 / 6.5)
    assert spec["x_target_only"] == pytest.approx((200 / 7.0) / (200 / 6.5))
    assert spec["ratios"] == pytest.approx([50 / 40, 20 / 25])  # each run against the target-only run beside it
    assert alone["ratios"] == pytest.approx([1.0, 1.0])


def test_the_per_level_table_pairs_each_run_with_target_onlys_run_at_the_same_repeat():
    extra = {k: 0 for k in ("steps", "rows", "prefill_rows", "reused_rows", "proposed", "accepted")}
    records = [{**_record("spec", 4, 100, 2.0), **extra}, {**_record("target-only", 4, 100, 2.5), **extra},
               {**_record("target-only", 4, 100, 4.0), **extra}, {**_record("spec", 4, 100, 5.0), **extra}]
    per_level = _script().report_blocks(records)[0].splitlines()[2:]
    ratios = [[c.strip() for c in line.strip("|").split("|")][3] for line in per_level]
    assert ratios == ["1.250", "1.000", "1.000", "0.800"]  # run 1: 50 / 40, run 2: 20 / 25 (not 20 / 40)
