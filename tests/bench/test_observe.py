"""`osd bench observe`: what a learning server's serving thread pays to hand each step to the learner."""
from __future__ import annotations

import json


def test_bench_observe_times_each_proposal_count_and_learns_every_verified_row(tmp_path):
    from osd_bench.observe import run_observe
    from osd_bench.report import report_observe

    result = run_observe(proposals=(0, 3), context=40, vocab=2000, top_k=16, repeats=6)
    steps = result["per_sequence_step"]
    assert set(steps) == {"0", "3"}
    for k, r in steps.items():
        assert r["rows"] == int(k) + 1
        assert r["positions_per_step"] == int(k) + 1  # --learn-mode all: every verified row is a position to learn
        assert 0 < r["top_k_ms"] and 0 < r["observe_ms"]
    out = tmp_path / "observe.json"
    report_observe(result, str(out), "")
    written = json.loads(out.read_text())
    assert written["per_sequence_step"] == steps and "machine" in written and "git" in json.dumps(written)
