"""`osd bench speed --busy-calibration N`: each osd_q4* arm calibrates beside N spinning processes, none of which
outlive the calibration (the decoding runs on a quiet machine)."""
from contextlib import contextmanager

import osd_bench.neighbours as neighbours
from osd_bench.neighbours import busy_neighbours
from osd_bench.speed import _calibrated_arm


def test_busy_neighbours_spin_for_the_block_and_are_gone_after_it():
    with busy_neighbours(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs)
    with busy_neighbours(0) as none:
        assert none == []


def test_an_arm_calibrates_beside_the_neighbours_and_decodes_without_them(monkeypatch):
    seen = []
    real = neighbours.busy_neighbours

    @contextmanager
    def recording(n):
        with real(n) as procs:
            seen.append(procs)
            yield procs
    monkeypatch.setattr(neighbours, "busy_neighbours", recording)

    class Engine:
        def calibrate(self):
            return {"alive beside the calibration": sum(p.poll() is None for p in seen[-1])}

    run = _calibrated_arm(Engine(), 8, busy=2)
    assert run.calibration == {"alive beside the calibration": 2}
    assert all(p.returncode is not None for p in seen[-1])  # gone before any prompt is decoded
    assert _calibrated_arm(Engine(), 8).calibration == {"alive beside the calibration": 0}
