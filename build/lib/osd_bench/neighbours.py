"""A noisy neighbour on demand: processes that spin on the CPU while a block runs (`osd bench speed
--busy-calibration N`: each osd_q4 arm measures its costs beside them, then decodes on a quiet machine, the case of a
calibration a busy spell inflated)."""
from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager


@contextmanager
def busy_neighbours(n: int, settle_seconds: float = 0.2):
    """n processes spinning for the duration of the block (none for n = 0); yields them, kills them on the way out."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(0, n))]
    try:
        if procs:
            time.sleep(settle_seconds)  # the interpreters start before the block measures anything
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
