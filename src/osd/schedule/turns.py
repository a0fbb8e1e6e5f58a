"""The cores, one party at a time: the scheduler's steps (serving) or a background job's chunks (the learner).

On a 2-core machine the model's kernels and torch each run an OpenMP team of one thread per core; two teams at once
(a scheduler step and a learner chunk on another thread) preempt each other's threads at every barrier, and each
loses far more than the other's share: a background learner that worked ~14% of the wall time cost serving 31% of its
tokens/s at 8 clients (AMD EPYC, in-process), and the learner's chunks inflated the step costs that the goodput
allocation reads. So a chunk runs between two steps, never beside one: serving then loses about the time the chunk
takes, which the learner bounds by its busy share (learn/budget.py), earned from the steps' seconds that Turns reports
to its `listeners`.

A background job that asks for the cores gets them at the next step boundary, ahead of the step loop (it asks only
once its budget lets it: learn/budget.py); it gives them back before it waits again. Steps and admissions take `serving()`
and never nest in it.

Giving the cores back also ends the background thread's OpenMP team (`end_thread_team`). libgomp counts the threads of
every team in the process, and once they outnumber the cores it stops letting idle team threads spin between parallel
regions: the serving thread's worker then sleeps after each of the ~150 regions of a target pass and is woken for the
next. A learning server's target passes took ~20% longer per row with the learner merely waiting (8 clients, AMD
EPYC, `osd_schedule_step_seconds_total`; a no-learn server with one idle extra thread that had once run a two-thread
torch op: the same), and the goodput allocation, reading those slower steps, proposed twice as many tokens.
"""
from __future__ import annotations

import ctypes
import threading
import time
from contextlib import contextmanager
from functools import cache


class Turns:
    def __init__(self):
        self._cond = threading.Condition()
        self._serving = 0  # steps (or admissions) in flight
        self._background = None  # the owner of the chunk that holds the cores (None: no chunk holds them)
        self._asking = 0  # background jobs waiting for the cores
        self.listeners: list = []  # called with each serving section's seconds as it ends (learn/budget.py's credit)

    @contextmanager
    def serving(self):
        """Held around one step: waits while a background chunk holds the cores or asks for them."""
        with self._cond:
            while self._background is not None or self._asking:
                self._cond.wait()
            self._serving += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            with self._cond:
                self._serving -= 1
                self._cond.notify_all()
            for listener in list(self.listeners):
                listener(seconds)

    def take(self, owner, stop: threading.Event | None = None) -> bool:
        """Take the cores for `owner`'s background work once no step (and no other owner's chunk) is in flight -> True,
        or False if `stop` got set."""
        with self._cond:
            if self._background is owner:
                return True
            self._asking += 1
            try:
                while self._serving or self._background is not None:
                    if stop is not None and stop.is_set():
                        return False
                    self._cond.wait(timeout=0.05 if stop is not None else None)
            finally:
                self._asking -= 1
                self._cond.notify_all()
            self._background = owner
            return True

    def give_back(self, owner) -> None:
        """End `owner`'s background turn (if it holds one) and, in any case, the calling thread's OpenMP team: called on
        the thread that did the work before it waits again, and torch ops it ran without the cores (an update's
        restore point before its first chunk) started a team too, which would otherwise idle beside serving for as
        long as the wait for credit lasts."""
        with self._cond:
            if self._background is owner:
                self._background = None
                self._cond.notify_all()
        end_thread_team()

    @property
    def background(self) -> bool:
        """Whether a background chunk holds the cores now."""
        return self._background is not None


@cache
def _libgomp():
    """The GNU OpenMP runtime torch runs on in this process, or None (another runtime); looked up once."""
    import torch  # noqa: F401 - loads the runtime before the lookup

    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]), None)
        lib = ctypes.CDLL(path) if path else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "omp_pause_resource_all") else None


def end_thread_team() -> bool:
    """Let the calling thread's OpenMP worker threads go (omp_pause_resource_all(omp_pause_soft): libgomp frees the
    calling thread's pool); its next parallel region starts a new team (~0.1 ms). True if done. A no-op where torch
    runs another OpenMP runtime (or inside a parallel region)."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(1) == 0  # 1 = omp_pause_soft
