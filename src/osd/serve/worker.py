"""Model work off the event loop: one thread drives the engine's scheduler (continuous batching).

Jobs queue in arrival order; between steps the worker admits as many as the scheduler has room for (a bad request
fails alone, at admission), drops the ones whose client went away, and runs one step for every running sequence
(schedule/scheduler.py). Each job owns an asyncio.Queue on the request's loop; the worker thread feeds it with
loop.call_soon_threadsafe, so it never blocks on a client: a slow reader only lets its own queue grow.
Events: ("text", delta), ("done", GenerationResult), ("error", exception). Where the request asked for logprobs, each
text event's tokens' logprobs wait in the job's `chunk_logprobs`, one list per text event in the same order (the
tokens committed since the previous one; the text may lag them by what is held back); the rest are the result's.
The queue is bounded (`max_queue` waiting jobs; past it `submit` raises QueueFull: 503 with Retry-After).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from osd.config import SamplingConfig
from osd.route import pinned
from osd.serve.errors import QueueFull, ShuttingDown

CANCELLED = "request cancelled (client gone or server shutting down)"

log = logging.getLogger("osd.serve")


@dataclass
class Job:
    prompt_ids: list[int]
    sampling: SamplingConfig
    loop: asyncio.AbstractEventLoop
    stream: bool = False  # emit ("text", delta) events; otherwise only the outcome
    draft: str | None = None  # the draft the request pinned (None: routed)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # set from the loop; read by the worker (a plain flag is enough)
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    first_text_at: float | None = None
    chunk_logprobs: deque = field(default_factory=deque)  # per text event: its tokens' TokenLogprobs (when asked)
    logprobs_sent: int = 0  # of the sequence's logprobs, how many went with text events (the worker's count)

    def emit(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled = True

    async def next(self) -> tuple[str, object]:
        return await self.events.get()


class Worker:
    """Runs submitted jobs on the engine's scheduler, many at once, on one thread: its own daemon thread (`start`), or
    the thread that calls `run_here` (`osd serve` runs it on the main thread, the HTTP server on another).

    Why the main thread: the model's kernels parallelise with OpenMP, whose thread team belongs to the thread that
    calls them; the main thread's team (which loaded and calibrated the model) stays, and a second team on another
    thread competes with it for the 2 cores: one target token took 40-48 ms from a worker thread against 31-36 ms
    from the main thread here (AMD EPYC, 2 cores), which is most of the serving path's loss against `osd bench speed`.
    """

    def __init__(self, engine, own_thread: bool = True, max_queue: int = 0):
        """max_queue: the most jobs waiting for a place in the scheduler (0 = no bound)."""
        self.engine, self.scheduler, self.own_thread, self.max_queue = engine, engine.scheduler, own_thread, max_queue
        self._queue: queue.Queue[Job | None] = queue.Queue()
        engine.queued = self._queue.qsize  # what the learner's budget reads as requests waiting (Engine.pressure)
        self._thread: threading.Thread | None = None
        self._closing = False
        self._gate = threading.RLock()  # no job can slip in behind the stop sentinel
        self._jobs: dict[int, Job] = {}  # id(sequence) -> its job, while it runs
        self._done = threading.Event()  # set when the loop has ended

    def start(self) -> None:
        with self._gate:
            if self._thread is None and self.own_thread:
                self._thread = threading.Thread(target=self._run, name="osd-serve-worker", daemon=True)
                self._thread.start()

    def run_here(self, keep_going=lambda: True) -> None:
        """Run the jobs on the calling thread until `stop` (or until keep_going() turns false: the HTTP server died)."""
        with self._gate:
            self._thread = threading.current_thread()
        self._run(keep_going)

    def stop(self, timeout: float | None = 60.0, cancel_running: bool = False) -> None:
        """Refuse new jobs and fail the queued ones; the running ones finish unless cancel_running
        (the server's shutdown cancels: by then their client connections are closed)."""
        with self._gate:
            self._closing = True
            self._queue.put(None)
            if cancel_running:
                for job in list(self._jobs.values()):
                    job.cancelled = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._done.wait(timeout)  # the loop answered what was left (whichever thread runs it)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._done.is_set()

    @property
    def depth(self) -> int:
        """Jobs waiting for a place in the scheduler."""
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return len(self._jobs)

    def submit(self, prompt_ids: list[int], sampling: SamplingConfig, stream: bool = False, draft: str | None = None) -> Job:
        job = Job(prompt_ids, sampling, asyncio.get_running_loop(), stream, draft=draft)
        with self._gate:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if self.max_queue and self._queue.qsize() >= self.max_queue:
                raise QueueFull(f"the server is at capacity: {self._queue.qsize()} requests are waiting already "
                                f"(--max-queue {self.max_queue}); retry later")
            self.start()  # normally started by the app's lifespan; harmless when already running
            self._queue.put(job)
        return job

    def _run(self, keep_going=lambda: True) -> None:
        stopping = False
        while not stopping or self._jobs:
            stopping = self._admit(block=not self._jobs) or stopping or not keep_going()
            with self.engine.lock:
                for seq in [s for s in self.scheduler.running if self._jobs[id(s)].cancelled]:
                    self.scheduler.cancel(seq)
                    self._jobs.pop(id(seq)).emit("error", ShuttingDown(CANCELLED))
                try:
                    done = self.scheduler.step() if self.scheduler.running else []
                except Exception as e:  # a fault outside any one sequence: they all get it, the worker lives on
                    log.exception("a scheduler step failed")
                    done = self.scheduler.fail_all(e)
            for seq in done:
                self._finish(seq)
        self._fail_queued()
        self._done.set()

    def _admit(self, block: bool) -> bool:
        """Move queued jobs into the scheduler while it has room -> whether the stop sentinel was reached."""
        while len(self._jobs) < self.scheduler.capacity:
            try:
                job = self._queue.get(block=block, timeout=0.5 if block else None)  # wakes to check keep_going
            except queue.Empty:
                return False
            block = False
            if job is None:
                return True
            if not job.cancelled:
                self._start(job)
        return False

    def _start(self, job: Job) -> None:
        seq = None

        def on_text(delta: str) -> None:
            if job.first_text_at is None:
                job.first_text_at = time.perf_counter()
            if job.stream:
                if seq.logprobs is not None:  # before the event: the loop pops one list per text event
                    job.chunk_logprobs.append(seq.logprobs[job.logprobs_sent:])
                    job.logprobs_sent = len(seq.logprobs)
                job.emit("text", delta)

        job.started_at = time.perf_counter()
        try:
            with self.engine.lock, pinned(job.draft):
                seq = self.scheduler.add(job.prompt_ids, job.sampling, on_text=on_text)
        except Exception as e:  # a bad request fails alone; the handler maps the error
            job.emit("error", e)
            return
        self._jobs[id(seq)] = job

    def _finish(self, seq) -> None:
        job = self._jobs.pop(id(seq))
        if seq.error is not None:
            job.emit("error", seq.error)
            return
        job.emit("done", seq.result)
        try:
            self.engine.observe_request(seq.result)
        except Exception:  # an observer's failure never kills the worker
            log.exception("a request observer failed")

    def _fail_queued(self) -> None:
        while True:  # closing: answer whatever is still queued
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.emit("error", ShuttingDown("the server is shutting down"))
