"""`osd bench passes`: the grid of passes it times, and the scheduler's cost model fitted on it."""
from __future__ import annotations

import json

import pytest

from conftest import require_module, require_q4

from tests.models.tiny_gguf import tiny  # noqa: F401 - a fixture


def test_bench_passes_times_every_shape_and_fits_the_schedulers_cost_model(tiny, tmp_path):
    require_module("llama_cpp")  # writes the tiny GGUF
    require_q4()
    from osd_bench.passes import CURVE_ROWS, run_passes
    from osd_bench.report import report_passes

    result = run_passes(str(tiny[0]), contexts=(16, 96), sequences=(1, 3), rows_each=(1, 2), repeats=0)
    shapes = {(g["context"], g["sequences"], g["rows_each"]) for g in result["grid"]}
    assert shapes == {(c, s, r) for c in (16, 96) for s in (1, 3) for r in (1, 2)} | {(16, 1, r) for r in CURVE_ROWS}
    for g in result["grid"]:
        assert g["seconds"] > 0 and g["rows"] == g["sequences"] * g["rows_each"]
        if g["context"] == 16 and g["sequences"] == 1:  # one sequence at the curve's own context: the curve
            assert g["model_seconds"] == pytest.approx(g["rows_only_seconds"])
    model = result["pass_model"]
    assert model["base_context"] == 16 and all(model[t] >= 0 for t in ("per_sequence", "per_sequence_context",
                                                                        "per_row_context"))
    out = tmp_path / "passes.json"
    report_passes(result, str(out), "")
    written = json.loads(out.read_text())
    assert written["grid"] == result["grid"] and "machine" in written and "git" in json.dumps(written)
