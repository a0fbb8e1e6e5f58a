"""`osd eval` / `osd distill` pick their calibration explicitly or by the date recorded inside the file, not mtime."""
import json
import os

import pytest

from osd.config import ModelConfig
from osd.distill.evaluate import newest_calibration
from osd.errors import InvalidArgument


def write(root, name, timestamp, c, draft_vocab=0, mtime=None):
    body = {"config": {"models": {"draft_quantize": "int8", "draft_vocab": draft_vocab}},
            "calibration": {"c": c, "verify_cost": [1.0, 1.1]}}
    if timestamp:
        body["timestamp"] = timestamp
    path = root / name
    path.write_text(json.dumps(body))
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


@pytest.fixture
def bench_dir(tmp_path):
    # modification times say the opposite of the recorded dates (and a fresh clone makes them all equal)
    write(tmp_path, "bench-speed-new.json", "2026-11-23T20:07:10Z", c=0.3, mtime=1_000)
    write(tmp_path, "bench-speed-old.json", "2026-11-22T03:20:13Z", c=0.1, mtime=3_000)
    write(tmp_path, "bench-speed-undated.json", None, c=0.9, mtime=4_000)
    write(tmp_path, "bench-speed-vocab.json", "2026-11-24T00:00:00Z", c=0.5, draft_vocab=32768, mtime=2_000)
    return tmp_path


def test_default_is_the_newest_recorded_date_among_matching_settings(bench_dir):
    models = ModelConfig(draft_quantize="int8", draft_vocab=0)
    chosen = newest_calibration(models=models, root=str(bench_dir))
    assert chosen["c"] == 0.3 and chosen["recorded_at"] == "2026-11-23T20:07:10Z"
    assert chosen["source"].endswith("bench-speed-new.json")
    other = newest_calibration(models=ModelConfig(draft_quantize="int8", draft_vocab=32768), root=str(bench_dir))
    assert other["c"] == 0.5
    os.utime(bench_dir / "bench-speed-old.json", (1_000, 1_000))  # equal mtimes change nothing
    assert newest_calibration(models=models, root=str(bench_dir))["c"] == 0.3


def test_an_explicit_file_wins_and_a_bad_one_is_an_error(bench_dir):
    assert newest_calibration(str(bench_dir / "bench-speed-undated.json"), root=str(bench_dir))["c"] == 0.9
    assert newest_calibration("none", root=str(bench_dir)) is None
    with pytest.raises(InvalidArgument, match="cannot read"):
        newest_calibration(str(bench_dir / "missing.json"))
    (bench_dir / "no-cal.json").write_text(json.dumps({"timestamp": "2026-11-23T20:07:10Z"}))
    with pytest.raises(InvalidArgument, match="holds no 'calibration'"):
        newest_calibration(str(bench_dir / "no-cal.json"))


def test_no_matching_file_means_no_calibration(tmp_path):
    assert newest_calibration(models=ModelConfig(), root=str(tmp_path)) is None
