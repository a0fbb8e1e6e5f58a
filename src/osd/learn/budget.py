"""The learner's time on a serving machine: idle windows free, and while requests decode a share of the cores
earned from the serving steps themselves, in chunks that fit between two steps.

Serving runs in steps (schedule/scheduler.py). The engine's Turns (schedule/turns.py) reports each step's seconds
here (`served`) as it gives the cores back. Every second of serving earns the learner share / (1 - share) seconds of
credit; a chunk of learner work (one micro-batch's forward/backward, one chunk of a held-out evaluation) that runs
while requests decode is charged its measured seconds. So over any busy stretch

    learner seconds under load <= share / (1 - share) x serving seconds + one chunk

i.e. the learner holds `share` of the busy time, whatever the load: the grant follows the measured cost of serving
(heavy steps earn more, no steps earn nothing), not a fixed wait. The same rule makes the learner publish on a
server that is never idle (the old idle-window rule waited up to (1 - share) / share x its own work before each
chunk: at the serving share 0.05 an update took ~20x its work and a 75 s load saw 0 optimizer steps,
benchmarks/bench-scale-noray-48-steps.json).

A chunk starts while requests decode only when
  - the credit covers the chunk's expected cost (the mean of the measured chunks), and
  - a serving step has run since the last chunk (idle or not): a scheduler step waits for one chunk at most.
Under pressure (`pressure()`: a request waits for its first token, queued or prefilling: Engine.pressure) no chunk
starts while requests decode and no credit is earned: the learner's share comes out of the time the server has to
spare, never out of a waiting request's first token (a chat stream at 0.5 of capacity with the share taken
regardless: TTFT p50 1.2 s -> 3-5 s as the queue grew, benchmarks/archive/live/bench-live-chat300-load05-no-backoff.json).
Credit is capped at `burst` (at least two expected chunks): a learner with nothing to do does not hoard a long busy
stretch's share and then hold the cores for it. Idle (no request decoding) a chunk starts at once and is not
charged: idle time is free; a request that arrives meanwhile waits for that one chunk.
A chunk runs between two serving steps, never beside one (`turns`): wait() ends by taking the cores once the step in
flight ends, and release() gives them back.

Without Turns (a cluster's learner, whose serving runs in other processes, or a test's fake engine) there are no step
reports: credit is then earned by wall time while `busy()` reads true, at the same rate.
Limitations: a chunk's length is the learner's (items up to its chunk_positions); chunks longer than `max_chunk` are
counted (`chunks_over_limit`), not split. Several learners on one engine (per-draft learners) each earn the share.
"""
from __future__ import annotations

import threading
import time

from osd.errors import InvalidArgument


class LearnBudget:
    def __init__(self, share: float, busy, clock=time.monotonic, sleep=None, poll: float = 0.005,
                 max_poll: float = 0.1, stop: threading.Event | None = None, max_chunk: float = 0.25,
                 burst: float = 0.5, pressure=lambda: False):
        if not 0.0 < share <= 1.0:
            raise InvalidArgument(f"busy_share must be in (0, 1], got {share}")
        self.share, self.busy, self.clock, self.pressure = share, busy, clock, pressure
        self.poll, self.max_poll = poll, max(poll, max_poll)
        self.max_chunk, self.burst = max_chunk, burst
        self.stop = stop or threading.Event()
        self._ready = threading.Event()  # set by `served` once a chunk under load may start
        self.sleep = sleep or self._sleep
        self._lock = threading.Lock()
        self.credit = 0.0  # seconds the learner may still spend while requests decode
        self.expected = 0.0  # mean seconds of a chunk (exponential average of the measured ones)
        self.steps_since_chunk = 1  # serving steps since the last chunk under load
        self._chunk: tuple[float, bool] | None = None  # (start, under load) of the chunk that holds the cores
        self._turns = None
        # counters: seconds and chunks (monotonic)
        self.serving_seconds = 0.0  # serving steps reported (or busy wall time earned, without Turns)
        self.pressed_seconds = 0.0  # ... of which under pressure (a request waiting for its first token): no credit
        self.busy_seconds = self.idle_seconds = 0.0  # learner chunks under load (charged) / while idle (free)
        self.busy_chunks = self.idle_chunks = self.over_limit = 0
        self.waited_total = 0.0  # seconds spent waiting for a chunk's turn
        self.longest = 0.0  # the longest chunk, seconds

    # --- the serving side -------------------------------------------------------------------------
    @property
    def turns(self):
        return self._turns

    @turns.setter
    def turns(self, turns) -> None:
        """The engine's Turns: chunks run between its steps, and its steps' seconds earn the credit."""
        if self._turns is not None and self.served in self._turns.listeners:
            self._turns.listeners.remove(self.served)
        self._turns = turns
        if turns is not None:
            turns.listeners.append(self.served)

    def rate(self) -> float:
        """Learner seconds earned per second of serving."""
        return float("inf") if self.share >= 1.0 else self.share / (1.0 - self.share)

    def served(self, seconds: float) -> None:
        """One serving step took `seconds` (called on the serving thread when it gives the cores back)."""
        pressed = self.pressure()
        with self._lock:
            self._count_serving(seconds, pressed)
            ready = not pressed and self._may_start_busy()
        if ready:
            self._ready.set()

    def _count_serving(self, seconds: float, pressed: bool) -> None:
        """`seconds` of serving (a step, or busy wall time without Turns): counted, and earning credit unless
        `pressed`. Hold the lock."""
        self.serving_seconds += seconds
        self.steps_since_chunk += 1
        if pressed:
            self.pressed_seconds += seconds
        else:
            self._earn(seconds)

    def _earn(self, seconds: float) -> None:
        cap = max(self.burst, 2.0 * self.expected)
        self.credit = cap if self.share >= 1.0 else min(cap, self.credit + seconds * self.rate())

    def _may_start_busy(self) -> bool:
        return self.steps_since_chunk >= 1 and self.credit > 0.0 and self.credit >= self.expected

    # --- the learner side -------------------------------------------------------------------------
    def begin(self) -> None:
        """A new update starts (kept for the learner's call; the credit carries over between updates)."""

    def wait(self) -> None:
        """Return when a chunk may run (the engine idle, or the credit covers one under load) or `stop` is set,
        holding the cores (with `turns`)."""
        self.release()
        start = last = self.clock()
        delay, under_load = self.poll, False
        while not self.stop.is_set():
            if not self.busy():
                break
            now = self.clock()
            with self._lock:
                pressed = self.pressure()
                if self._turns is None:  # no step reports: busy wall time earns the credit
                    self._count_serving(now - last, pressed)
                last = now
                if not pressed and self._may_start_busy():
                    under_load = True
                    break
            self.sleep(delay)
            delay = min(2 * delay, self.max_poll)
        if self._turns is not None:
            self._turns.take(self, self.stop)  # the step in flight ends first
        now = self.clock()
        self.waited_total += now - start
        self._chunk = (now, under_load)

    def release(self) -> None:
        """The chunk of work ended: charge it (under load) and give the cores back to serving."""
        if self._chunk is not None:
            began, under_load = self._chunk
            self._chunk = None
            seconds = max(0.0, self.clock() - began)
            with self._lock:
                self.expected = seconds if not (self.busy_chunks + self.idle_chunks) else \
                    0.8 * self.expected + 0.2 * seconds
                self.longest = max(self.longest, seconds)
                self.over_limit += seconds > self.max_chunk
                self.steps_since_chunk = 0  # (an idle chunk too: a request that arrived during it steps next)
                if under_load:
                    self.credit -= seconds
                    self.busy_seconds += seconds
                    self.busy_chunks += 1
                else:
                    self.idle_seconds += seconds
                    self.idle_chunks += 1
        if self._turns is not None:
            self._turns.give_back(self)

    def _sleep(self, seconds: float) -> None:
        """Wait `seconds`, or until a serving step leaves enough credit for a chunk."""
        if self._ready.wait(seconds):
            self._ready.clear()

    def stats(self) -> dict:
        """Counters for the learner's stats (/metrics): its seconds under load and idle, serving's, its chunks."""
        return {"learner_busy_seconds": self.busy_seconds, "learner_idle_seconds": self.idle_seconds,
                "serving_seconds": self.serving_seconds, "serving_seconds_under_pressure": self.pressed_seconds,
                "chunks_under_load": self.busy_chunks,
                "chunks_idle": self.idle_chunks, "chunks_over_limit": self.over_limit,
                "idle_wait_seconds": self.waited_total, "chunk_seconds_max": self.longest,
                "busy_share_measured": self.busy_seconds / (self.busy_seconds + self.serving_seconds)
                if self.busy_seconds + self.serving_seconds else 0.0}
