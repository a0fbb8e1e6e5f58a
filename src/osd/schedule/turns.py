"""The cores, one party at a time: the scheduler's steps (serving) or a background job's chunks (the learner).

On a 2-core machine the model's kernels and torch each run an OpenMP team of one thread per core; two teams at once
(a scheduler step and a learner chunk on another thread) preempt each other's threads at every barrier, and each
loses far more than the other's share: a background learner that worked ~14% of the wall time cost serving 31% of its
tokens/s at 8 clients (AMD EPYC, in-process), and the learner's chunks inflated the step costs that the goodput
allocation reads. So a chunk runs between two steps, never beside one: serving then loses about the time the chunk
takes, which the learner bounds by its busy share (learn/idle.py).

A background job that asks for the cores gets them at the next step boundary, ahead of the step loop (it asks only
once its idle-window budget lets it); it gives them back before it waits again. Steps and admissions take `serving()`
and never nest in it.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager


class Turns:
    def __init__(self):
        self._cond = threading.Condition()
        self._serving = 0  # steps (or admissions) in flight
        self._background = None  # the owner of the chunk that holds the cores (None: no chunk holds them)
        self._asking = 0  # background jobs waiting for the cores

    @contextmanager
    def serving(self):
        """Held around one step: waits while a background chunk holds the cores or asks for them."""
        with self._cond:
            while self._background is not None or self._asking:
                self._cond.wait()
            self._serving += 1
        try:
            yield
        finally:
            with self._cond:
                self._serving -= 1
                self._cond.notify_all()

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
        """End `owner`'s background turn (nothing if it holds none)."""
        with self._cond:
            if self._background is owner:
                self._background = None
                self._cond.notify_all()

    @property
    def background(self) -> bool:
        """Whether a background chunk holds the cores now."""
        return self._background is not None
