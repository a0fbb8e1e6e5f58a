"""Model work off the event loop: one thread runs queued jobs in order (the engine is batch-1).

Each job owns an asyncio.Queue on the request's loop; the worker thread feeds it with
loop.call_soon_threadsafe, so it never blocks on a client: a slow reader only lets its own queue
grow. Events: ("text", delta), ("done", GenerationResult), ("error", exception).
A job whose client went away is skipped if still queued and aborted at its next text delta.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from osd.config import SamplingConfig
from osd.route import pinned
from osd.serve.errors import ShuttingDown

log = logging.getLogger("osd.serve")


class _Cancelled(Exception):
    """Raised inside on_text to abort a generation whose client is gone."""


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

    def emit(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled = True

    async def next(self) -> tuple[str, object]:
        return await self.events.get()


class Worker:
    """Runs engine.generate for submitted jobs, one at a time, on a single daemon thread."""

    def __init__(self, engine):
        self.engine = engine
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._gate = threading.RLock()  # no job can slip in behind the stop sentinel
        self._current: Job | None = None

    def start(self) -> None:
        with self._gate:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="osd-serve-worker", daemon=True)
                self._thread.start()

    def stop(self, timeout: float | None = 60.0, cancel_running: bool = False) -> None:
        """Refuse new jobs and fail the queued ones; the running one finishes unless cancel_running
        (the server's shutdown cancels: by then its client connection is closed)."""
        with self._gate:
            self._closing = True
            self._queue.put(None)
            if cancel_running and self._current is not None:
                self._current.cancelled = True
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def submit(self, prompt_ids: list[int], sampling: SamplingConfig, stream: bool = False, draft: str | None = None) -> Job:
        job = Job(prompt_ids, sampling, asyncio.get_running_loop(), stream, draft=draft)
        with self._gate:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            self.start()  # normally started by the app's lifespan; harmless when already running
            self._queue.put(job)
        return job

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if not job.cancelled:
                self._current = job
                self._run_job(job)
                self._current = None
        while True:  # closing: answer whatever is still queued
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.emit("error", ShuttingDown("the server is shutting down"))

    def _run_job(self, job: Job) -> None:
        def on_text(delta: str) -> None:
            if job.cancelled:
                raise _Cancelled
            if job.first_text_at is None:
                job.first_text_at = time.perf_counter()
            if job.stream:
                job.emit("text", delta)

        job.started_at = time.perf_counter()
        try:
            with pinned(job.draft):
                job.emit("done", self.engine.generate(job.prompt_ids, job.sampling, on_text=on_text))
        except _Cancelled:  # nobody should be waiting; answer anyway so no waiter can hang
            job.emit("error", ShuttingDown("request cancelled (client gone or server shutting down)"))
        except Exception as e:  # a bad request never kills the worker; the handler maps the error
            job.emit("error", e)
