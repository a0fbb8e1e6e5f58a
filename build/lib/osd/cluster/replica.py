"""One serving replica (a Ray actor's body): a whole engine with its scheduler and worker thread, as `osd serve` runs
in one process, plus the two links of the cluster: its verification samples go to the learner (samples.py), and
published draft versions come in (`swap`), taken up between scheduler steps by requests that start after them
(drafts.py: a request holds one snapshot), never older than the one it serves."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from osd.build import DEFAULT_DRAFT
from osd.cluster.names import LEARNER, NAMESPACE
from osd.cluster.samples import SampleShipper
from osd.cluster.weights import with_arrays
from osd.memory import trim

log = logging.getLogger("osd.cluster")


class ReplicaNode:
    def __init__(self, index: int, models, spec, learn=None, namespace: str = NAMESPACE, calibrate: bool = True):
        self.index, self.namespace, self.learn = index, namespace, learn
        self._learner_handle = None
        self._built, self._build_error = threading.Event(), None
        threading.Thread(target=self._model_work, args=(models, spec, calibrate), name="osd-replica-model",
                         daemon=True).start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        self.version = 0  # the learner's version this replica serves (0: the draft it loaded)
        self.counters = {"swaps": 0, "swap_failures": 0, "swaps_ignored_old": 0}
        self.last_swap = {"version": 0, "publish_to_swap_seconds": None, "error": None}
        self._swap_lock = threading.Lock()
        self.shipper = None
        if learn is not None and DEFAULT_DRAFT in self.system.registry.names():
            self.shipper = SampleShipper(learn, self._send, _poll).attach(self.system.engine)
            self._catch_up()

    def _model_work(self, models, spec, calibrate: bool) -> None:
        """Load, calibrate, then run the scheduler, all on this one thread: the kernels' OpenMP thread team belongs to
        the thread that calls them, and a second team (loading on one thread, serving on another) competes with the
        first for the cores (serve/worker.py). The actor's own threads only pass messages and swap references."""
        from osd.build import build_system
        from osd.serve.worker import Worker

        try:
            self.system = build_system(models, spec)
            if calibrate:
                self.system.engine.calibrate()
            self.system.draft_master = None  # replicas do not train: versions arrive as serving tensors (weights.py)
            trim()
            self.worker = Worker(self.system.engine, own_thread=False)
        except BaseException as e:  # the actor's constructor raises it: Ray reports (and restarts) the replica
            self._build_error = e
            return
        finally:
            self._built.set()
        self.worker.run_here()

    # --- the learner link -------------------------------------------------------------------------------------
    def _learner(self):
        """The learner's handle, looked up once (a lookup is a round trip to Ray's control store); a restarted learner
        keeps its handle (Ray restarts the same actor)."""
        import ray

        if self._learner_handle is None:
            self._learner_handle = ray.get_actor(LEARNER, namespace=self.namespace)
        return self._learner_handle

    def _send(self, payload: bytes, requests: int):
        return self._learner().submit.remote(payload, requests, str(self.index))

    def _catch_up(self) -> None:
        """A (re)started replica asks for the newest published version and serves it before taking requests."""
        import ray

        try:
            version, refs, published_at = ray.get(self._learner().latest.remote(), timeout=60)
            if refs:
                self._swap(version, ray.get(refs[0], timeout=60), published_at)
        except Exception as e:  # no learner yet (it pushes when it publishes) or it is down: serve what we have
            log.warning("replica %d: no published draft fetched at start (%s); serving version %d",
                        self.index, e, self.version)

    async def swap(self, version: int, arrays: dict, published_at: float) -> dict:
        """Serve a published version (off the event loop: building the serving copy takes a while)."""
        return await asyncio.to_thread(self._swap, version, arrays, published_at)

    def _swap(self, version: int, arrays: dict, published_at: float) -> dict:
        with self._swap_lock:
            if version <= self.version:  # versions only go forward (a late or repeated push)
                self.counters["swaps_ignored_old"] += 1
                return self.stats()
            serving = self.system.registry.get(DEFAULT_DRAFT)
            try:
                model = with_arrays(serving.model, arrays)  # checked whole first; the served copy is not touched
            except Exception as e:
                return self._refused(version, e)
            self.system.registry.publish(DEFAULT_DRAFT, model, serving.vocab_ids, version)
            self.version = version
            self.counters["swaps"] += 1
            self.last_swap = {"version": version, "publish_to_swap_seconds": time.time() - published_at, "error": None}
            return self.stats()

    def _refused(self, version: int, error: Exception) -> dict:
        self.counters["swap_failures"] += 1
        self.last_swap = {**self.last_swap, "error": f"version {version} refused: {error}"}
        log.error("replica %d refused draft version %d: %s (still serving version %d)", self.index, version, error,
                  self.version)
        return self.stats()

    # --- serving ----------------------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling, draft: str | None = None):
        """Stream ("text", delta) events, then ("done", GenerationResult) or ("error", exception)."""
        job = self.worker.submit(prompt_ids, sampling, stream=True, draft=draft)
        try:
            while True:
                kind, payload = await job.next()
                yield kind, payload
                if kind != "text":
                    return
        finally:
            job.cancelled = True  # the front went away or cancelled: the scheduler drops the sequence

    def pid(self) -> int:
        """This actor's process (the fault tests kill -9 it)."""
        return os.getpid()

    def ready(self) -> int:
        return self.index

    def stats(self) -> dict:
        from osd.memory import process_memory

        registry = self.system.registry  # what a request starting now is served (swaps publish here)
        return {"index": self.index, "version": self.version, "draft_copy": self.system.models.draft_quantize,
                "drafts": {name: registry.get(name).version for name in registry.names()},
                **process_memory(), "pid": os.getpid(),
                "running": self.worker.running, "queued": self.worker.depth, **self.counters, "last_swap": self.last_swap,
                **(self.shipper.counters if self.shipper is not None else {})}

    def metrics_text(self) -> bytes:
        from osd.serve.prom import _EngineCollector, _LiveCollector

        registry = CollectorRegistry()
        registry.register(_LiveCollector(self.system.engine.metrics))
        registry.register(_EngineCollector(self.system.engine))
        registry.register(_StatsCollector(self))
        return generate_latest(registry)

    def stop(self) -> None:
        self.worker.stop(timeout=30, cancel_running=True)


class _StatsCollector:
    def __init__(self, replica: ReplicaNode):
        self.replica = replica

    def collect(self):
        s = self.replica.stats()
        yield GaugeMetricFamily("osd_replica_draft_version", "The learner's draft version this replica serves.",
                                value=s["version"])
        yield GaugeMetricFamily("osd_replica_queued", "Requests waiting for this replica's scheduler.", value=s["queued"])
        for key in ("rss_bytes", "peak_rss_bytes", "pid"):
            if key in s:
                yield GaugeMetricFamily(f"osd_replica_{key}", f"This replica's process {key.replace('_', ' ')}.",
                                        value=s[key])
        for key in ("swaps", "swap_failures", "swaps_ignored_old", "samples_shipped", "sample_bytes_shipped",
                    "payloads_shipped", "samples_dropped", "requests_shipped"):
            if key in s:
                yield CounterMetricFamily(f"osd_replica_{key}", f"Replica {key.replace('_', ' ')}.", value=s[key])
        latency = s["last_swap"]["publish_to_swap_seconds"]
        if latency is not None:
            yield GaugeMetricFamily("osd_replica_publish_to_swap_seconds",
                                    "Seconds from the learner's publish to this replica serving it (latest swap).",
                                    value=latency)


def _poll(ref) -> str:
    """A shipped payload's state: ok | failed | pending (never blocks)."""
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return "pending"
    try:
        ray.get(ready[0], timeout=0)
        return "ok"
    except Exception:
        return "failed"
