"""The one learner of a cluster (a Ray actor's body): the same OnlineLearner as in one process (triggers, trainer,
guard, drift guard, checkpoints, background schedule), fed by every replica's shipped samples instead of one engine's
observers, publishing each accepted version once into Ray's object store and pushing that one reference to every
replica. Restarted (Ray restarts it), it resumes from its last checkpoint; versions never go back."""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from osd.cluster.names import NAMESPACE, replica_name
from osd.cluster.weights import changed_prefixes, payload_bytes, serving_arrays

log = logging.getLogger("osd.cluster")
PROCESS_GAUGES = ("rss_bytes", "peak_rss_bytes", "pid")  # of this actor's process (stats())
TRAFFIC_WINDOW = 0.5  # seconds: samples arrived this recently = the replicas are busy (the learner's idle windows)


@dataclasses.dataclass
class Published:
    version: int


class LearnerNode:
    def __init__(self, models, learn, replicas: int, namespace: str = NAMESPACE):
        from osd.build import set_threads
        from osd.learn.online import OnlineLearner
        from osd.memory import trim
        from osd.models.loading import load_model, load_tokenizer
        from osd.models.tokenizer import special_ids

        set_threads(models.threads)
        self.models, self.special_ids = models, special_ids(load_tokenizer(models.target))
        self.replicas, self.namespace = replicas, namespace
        self.version, self.latest_ref, self.published_at = 0, None, 0.0
        self._last_traffic = 0.0
        self._lock = threading.Lock()
        self.counters = {"samples_received": 0, "sample_bytes_received": 0, "payloads_received": 0,
                         "requests_received": 0, "publishes": 0, "publish_bytes": 0, "pushes_failed": 0,
                         "submit_seconds": 0.0,  # taking samples in (unpickle + buffer): the ingest cost
                         "build_seconds": 0.0}  # building each version's serving copy and payload
        self.by_replica: dict[str, int] = {}
        master = load_model(models.draft, models.draft_dtype)
        if models.draft_quantize == "auto":  # timed here, once: every replica then serves (and is shipped) that kind
            from osd.propose.copy_choice import choose_copy

            kind = choose_copy(master, models.draft_vocab, self.special_ids, models.allow_kernel_fallback).quantize
            self.models = models = dataclasses.replace(models, draft_quantize=kind)
            trim()
        # (vocab_swap 0: replicas receive the trained tensors only, cluster/weights.py, not a head and its map)
        self.learner = OnlineLearner(master, self._publish, dataclasses.replace(learn, schedule="background", vocab_swap=0),
                                     engine_busy=lambda: time.monotonic() - self._last_traffic < TRAFFIC_WINDOW)
        self.learner.resume()  # the last checkpoint, published at its version (pushed to the replicas)
        self.learner.start()

    # --- in: samples --------------------------------------------------------------------------------------------
    def submit(self, payload: bytes, requests: int, replica: str = "?") -> int:
        start = time.perf_counter()
        now = time.monotonic()
        self._last_traffic = now
        pairs = pickle.loads(payload)
        for item, every in pairs:  # re-stamped: a replica's monotonic clock means nothing here
            self.learner.observe_item(item and dataclasses.replace(item, created_at=now),
                                      every and dataclasses.replace(every, created_at=now))
        for _ in range(requests):
            self.learner.after_request()
        with self._lock:
            c = self.counters
            c["samples_received"] += len(pairs)
            c["sample_bytes_received"] += len(payload)
            c["payloads_received"] += 1
            c["requests_received"] += requests
            self.by_replica[replica] = self.by_replica.get(replica, 0) + len(pairs)
            c["submit_seconds"] += time.perf_counter() - start
        return len(pairs)

    # --- out: versions --------------------------------------------------------------------------------------------
    def _publish(self, master, version: int | None = None) -> Published:
        """OnlineLearner's publish seam: build the serving copy once (as every replica serves it: quantized, vocabulary
        cut), put the tensors an update changes into the object store once, push that one reference to every replica."""
        import ray

        from osd.models.serving_draft import make_serving_draft

        start = time.perf_counter()
        m = self.models
        serving, _ = make_serving_draft(master, m.draft_quantize, m.draft_vocab, self.special_ids,
                                        m.allow_kernel_fallback)
        arrays = serving_arrays(serving, changed_prefixes(master))
        del serving
        self.counters["build_seconds"] += time.perf_counter() - start
        with self._lock:
            v = self.version + 1 if version is None else max(version, self.version + 1 if self.latest_ref else version)
            self.version, self.latest_ref, self.published_at = v, ray.put(arrays), time.time()
            self.counters["publishes"] += 1
            self.counters["publish_bytes"] = payload_bytes(arrays)
            ref, at = self.latest_ref, self.published_at
        for i in range(self.replicas):
            try:
                ray.get_actor(replica_name(i), namespace=self.namespace).swap.remote(v, ref, at)
            except ValueError:  # not created yet: it fetches the newest version when it starts (`latest`)
                self.counters["pushes_failed"] += 1
        return Published(v)

    def copy_kind(self) -> str:
        """The serving copy every version is built as (auto resolved at start): what the replicas must serve."""
        return self.models.draft_quantize

    def latest(self) -> tuple[int, list, float]:
        """(version, [reference] or [] before any publish, when it was published): what a starting replica serves."""
        with self._lock:
            return self.version, [self.latest_ref] if self.latest_ref is not None else [], self.published_at

    # --- control ----------------------------------------------------------------------------------------------------
    def publish_now(self) -> int:
        """Publish the master as it is as a new version (operations, and `osd bench scale` timing publish-to-swap);
        no training, no guard: the weights are the ones already serving or checkpointed."""
        with self.learner.lock():
            self.learner.version = self._publish(self.learner.master).version
            return self.learner.version

    def stats(self) -> dict:
        from osd.memory import process_memory

        return {**self.learner.stats(), "paused": self.learner.paused, **self.counters, **process_memory(),
                "pid": os.getpid(), "draft_copy": self.models.draft_quantize,
                "samples_by_replica": dict(self.by_replica)}

    def pause(self, timeout: float = 120.0) -> bool:
        return self.learner.pause(timeout)

    def unpause(self) -> None:
        self.learner.unpause()

    def update_now(self, reason: str = "manual") -> dict:
        """One update now, in the caller's call (tests, operators): the same guard decides whether it publishes."""
        report = self.learner.update(reason)
        return {k: v for k, v in report.items() if k != "losses"}

    def stop(self) -> None:
        """Stop training and write the checkpoint (the learner's own stop)."""
        self.learner.stop()

    def pid(self) -> int:
        """This actor's process (the fault tests kill -9 it)."""
        return os.getpid()

    def ready(self) -> int:
        return self.version

    def metrics_text(self) -> bytes:
        """The OnlineLearner's stats as osd_learner_*, this node's own as osd_cluster_* (from one stats() read)."""
        from osd.serve.prom import learner_families

        node = self

        class Collector:
            def collect(self):
                stats = node.stats()
                own = [*node.counters, *PROCESS_GAUGES]
                yield from learner_families({k: v for k, v in stats.items() if k not in own})
                for key in (k for k in own if k in stats):
                    kind = GaugeMetricFamily if key in PROCESS_GAUGES or key == "publish_bytes" else CounterMetricFamily
                    yield kind(f"osd_cluster_{key}", f"Cluster learner {key.replace('_', ' ')}.", value=stats[key])

        registry = CollectorRegistry()
        registry.register(Collector())
        return generate_latest(registry)
