"""The front's side of the replicas: what serve/app.py submits requests to instead of a local Worker (same
`submit` -> Job, `depth`, `alive`, `start`, `stop`). Each request goes to the replica with the fewest requests in
flight from this front; its events stream back through Ray. A replica that dies before the request streamed anything
is marked down and the request is retried on another; after text was streamed, a greedy or seeded request is run
again on another replica and its stream goes on where it stopped (the same tokens: `reproducible`), any other gets a
clear error (ReplicaFailed, 503). A marked-down replica comes back once it answers again (Ray restarts it)."""
from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from osd.serve.errors import ReplicaFailed, ShuttingDown
from osd.serve.worker import Job

log = logging.getLogger("osd.cluster")
LOST = (RayActorError, ActorDiedError, ActorUnavailableError)
POLL_SECONDS = 1.0


class ReplicaPool:
    def __init__(self, replicas: list, learner=None, owns_cluster: bool = True):
        self.replicas, self.learner_actor, self.owns_cluster = replicas, learner, owns_cluster
        self.inflight = [0] * len(replicas)
        self.down: set[int] = set()
        self.states: dict[str, dict] = {}  # label -> last stats (replicas and learner), refreshed by the poller
        self.texts: dict[str, str] = {}  # label -> last /metrics text
        self.counters = {"retries": 0, "resumed": 0, "replica_failures": 0, "failed_mid_stream": 0}
        self._closing = False
        self._tasks: set[asyncio.Task] = set()
        self._rr = 0

    # --- the Worker interface serve/app.py uses ----------------------------------------------------------------
    def start(self) -> None:
        self._spawn(self._poll_forever())

    def stop(self, timeout: float | None = 60.0, cancel_running: bool = False) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.get_loop().call_soon_threadsafe(task.cancel)
        if self.owns_cluster:
            for handle in self.replicas:
                try:
                    ray.get(handle.stop.remote(), timeout=timeout)
                except Exception:
                    pass

    @property
    def alive(self) -> bool:
        return not self._closing and len(self.down) < len(self.replicas)

    @property
    def depth(self) -> int:
        return sum(s.get("queued", 0) for label, s in self.states.items() if label != "learner")

    @property
    def running(self) -> int:
        return sum(self.inflight)

    def submit(self, prompt_ids, sampling, stream: bool = False, draft: str | None = None) -> Job:
        if self._closing:
            raise ShuttingDown("the server is shutting down")
        job = Job(prompt_ids, sampling, asyncio.get_running_loop(), stream, draft=draft)
        self._spawn(self._drive(job))
        return job

    def drafts(self) -> dict[str, int]:
        """Draft name -> the newest version any replica serves."""
        out: dict[str, int] = {}
        for label, state in self.states.items():
            for name, version in (state.get("drafts") or {}).items():
                out[name] = max(version, out.get(name, version))
        return out or {"default": 0}

    # --- one request ----------------------------------------------------------------------------------------------
    async def _drive(self, job: Job) -> None:
        tried: list[int] = []
        sent = ""  # text already streamed to the client
        while True:
            i = self._pick(tried)
            if i is None:
                job.emit("error", ReplicaFailed("no replica could take the request (all failed or down); retry later"))
                return
            tried.append(i)
            self.inflight[i] += 1
            text = ""  # this attempt's text; a resumed attempt re-derives `sent` first and streams only what follows
            gen = self.replicas[i].generate.options(num_returns="streaming").remote(job.prompt_ids, job.sampling,
                                                                                    job.draft)
            try:
                async for ref in gen:
                    kind, payload = await ref
                    if kind != "text":
                        job.emit(kind, payload)
                        return
                    text += payload
                    if len(text) > len(sent):
                        if not text.startswith(sent):  # a resumed attempt that differs: never splice two answers
                            job.emit("error", ReplicaFailed("a replica failed during the request and the retry's "
                                                            "text differs from what was streamed: send it again"))
                            ray.cancel(gen)
                            return
                        if job.first_text_at is None:
                            job.first_text_at = time.perf_counter()
                        if job.stream:
                            job.emit("text", text[len(sent):])
                        sent = text
                    if job.cancelled:  # the client went away: the replica drops the sequence
                        ray.cancel(gen)
                        return
                job.emit("error", ReplicaFailed(f"replica {i} ended the request without an answer"))
                return
            except LOST as e:
                self.counters["replica_failures"] += 1
                self._mark_down(i)
                if job.cancelled or (sent and not reproducible(job.sampling)):
                    self.counters["failed_mid_stream"] += 1
                    job.emit("error", ReplicaFailed(f"replica {i} failed during the request ({type(e).__name__}); "
                                                    "the text so far is incomplete: send the request again"))
                    return
                self.counters["resumed" if sent else "retries"] += 1
                log.warning("replica %d failed (%s): %s on another", i, type(e).__name__,
                            "resuming the stream" if sent else "retrying")
            except asyncio.CancelledError:
                ray.cancel(gen)
                raise
            except Exception as e:  # anything else from Ray: this request fails, the front lives on
                log.exception("request failed on replica %d", i)
                job.emit("error", e)
                return
            finally:
                self.inflight[i] -= 1

    def _pick(self, tried: list[int]) -> int | None:
        """The least loaded replica not yet tried (up ones first; a down one only when nothing else is left)."""
        fresh = [i for i in range(len(self.replicas)) if i not in tried]
        up = [i for i in fresh if i not in self.down] or fresh
        if not up:
            return None
        self._rr += 1
        return min(up, key=lambda i: (self.inflight[i], (i - self._rr) % len(self.replicas)))

    def _mark_down(self, i: int) -> None:
        if i not in self.down:
            self.down.add(i)
            self._spawn(self._revive(i))

    async def _revive(self, i: int) -> None:
        """Back in rotation once it answers (Ray restarts a killed replica: it loads, then fetches the newest draft)."""
        while not self._closing:
            try:
                await asyncio.wait_for(self.replicas[i].ready.remote(), timeout=30)
                self.down.discard(i)
                log.warning("replica %d is back", i)
                return
            except Exception:
                await asyncio.sleep(1.0)

    # --- state and metrics, fetched off the request path ------------------------------------------------------------
    async def _poll_forever(self) -> None:
        while not self._closing:
            await self.poll()
            await asyncio.sleep(POLL_SECONDS)

    async def poll(self) -> None:
        sources = {str(i): h for i, h in enumerate(self.replicas)}
        if self.learner_actor is not None:
            sources["learner"] = self.learner_actor
        for label, handle in sources.items():
            try:
                state, text = await asyncio.wait_for(
                    asyncio.gather(handle.stats.remote(), handle.metrics_text.remote()), timeout=5)
            except Exception:  # down or restarting: its last figures stay, marked stale by the up gauge
                self.states.setdefault(label, {})["up"] = 0
                continue
            self.states[label] = {**state, "up": 1}
            self.texts[label] = text.decode() if isinstance(text, bytes) else text

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def reproducible(sampling) -> bool:
    """Whether another replica gives this request the same tokens: greedy (bitwise identity per row), or sampled with
    a seed (a request's sampled tokens do not depend on what shares its steps). Such a request that lost its replica
    mid-stream is run again elsewhere and the client gets only the text it has not seen yet."""
    return sampling.temperature == 0 or sampling.seed is not None


class RemoteLearner:
    """The learner actor behind the interface serve/app.py's learner routes use (stats, paused, pause, unpause)."""

    def __init__(self, handle, pool: ReplicaPool, owns: bool = True):
        self.handle, self.pool, self.owns = handle, pool, owns

    def stats(self) -> dict:
        return ray.get(self.handle.stats.remote(), timeout=10)

    @property
    def paused(self) -> bool:
        return bool(self.pool.states.get("learner", {}).get("paused"))

    def pause(self, timeout: float = 120.0) -> bool:
        ok = ray.get(self.handle.pause.remote(timeout), timeout=timeout + 10)
        self.pool.states.setdefault("learner", {})["paused"] = True
        return ok

    def unpause(self) -> None:
        ray.get(self.handle.unpause.remote(), timeout=10)
        self.pool.states.setdefault("learner", {})["paused"] = False

    def start(self) -> None:
        pass

    def stop(self) -> None:
        """A front that owns the cluster stops the learner (it writes its checkpoint); a front that joined one leaves
        it learning."""
        if self.owns:
            try:
                ray.get(self.handle.stop.remote(), timeout=120)
            except Exception:
                log.exception("the learner did not stop cleanly")
