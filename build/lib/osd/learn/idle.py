"""Idle windows for background training, with a bound under load.

The background learner waits, before each chunk of work (one micro-batch's forward/backward, one chunk of a
held-out evaluation), until no request is decoding, so that a request shares the cores with at most one chunk.
Under constant load the engine is never idle: the wait is then bounded by a share of time. Within one update,
the waits add up to at most (1 - share) / share times the seconds worked so far; once that budget is spent, the
chunk runs while requests decode. Saturated, the learner so gets about `share` of the wall time and an update
takes about its own working time / share; idle, it never waits.

A chunk runs between two serving steps, never beside one (`turns`, the engine's schedule/turns.py): wait() ends by
taking the cores once the step in flight ends, and gives them back when it is called again (or at `release()`).
Limitations: the first chunk of an update has no budget (it may start while requests decode, between two of their
steps); without `turns` (an engine that has none) a chunk runs beside decoding and "worked", the wall time between
waits, includes the slowdown that causes. The busy signal is polled, first every `poll` seconds, then twice as long
after each busy poll up to `max_poll` (and never past the budget): under constant load the learner's thread wakes a
few times a second instead of 200 (each wake takes the GIL from the serving thread), and an idle window that follows a
long busy stretch is seen up to `max_poll` late.
"""
from __future__ import annotations

import threading
import time

from osd.errors import InvalidArgument

class IdleWindows:
    def __init__(self, share: float, busy, clock=time.monotonic, sleep=time.sleep, poll: float = 0.005,
                 stop: threading.Event | None = None, max_poll: float = 0.1):
        if not 0.0 < share <= 1.0:
            raise InvalidArgument(f"busy_share must be in (0, 1], got {share}")
        self.share, self.busy, self.clock, self.sleep, self.poll = share, busy, clock, sleep, poll
        self.max_poll = max(poll, max_poll)
        self.stop = stop or threading.Event()
        self.worked = self.waited = 0.0  # seconds in the current update
        self.waited_total = 0.0  # seconds, all updates
        self.forced = 0  # chunks that ran while requests decode because the budget was spent
        self._since: float | None = None  # when the current chunk of work began
        self.turns = None  # the engine's Turns (None: chunks may run beside steps), set when the learner attaches

    def begin(self) -> None:
        """A new update starts: its budget starts from zero."""
        self.worked = self.waited = 0.0
        self._since = self.clock()

    def budget(self) -> float:
        """Seconds this update may still wait."""
        return self.worked * (1.0 - self.share) / self.share - self.waited

    def wait(self) -> None:
        """Return when the engine is idle, the budget is spent, or `stop` is set; holding the cores (with `turns`)."""
        self.release()
        start = self.clock()
        if self._since is None:
            self._since = start
        self.worked += start - self._since
        budget, delay = self.budget(), self.poll
        while self.busy() and not self.stop.is_set():
            left = budget - (self.clock() - start)
            if left <= 0:
                self.forced += 1
                break
            self.sleep(min(delay, left))
            delay = min(2 * delay, self.max_poll)
        if self.turns is not None:
            self.turns.take(self, self.stop)  # the step in flight ends first
        end = self.clock()
        self.waited += end - start
        self.waited_total += end - start
        self._since = end

    def release(self) -> None:
        """Give the cores back to serving (the chunk of work ended)."""
        if self.turns is not None:
            self.turns.give_back(self)
