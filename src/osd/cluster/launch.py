"""Start the cluster's actors, or find them again by name (a restarted front), and serve HTTP in front of them.

Local (no address): `ray.init(num_cpus=<this machine's cores>)` starts Ray inside this process's session; the
actors live as long as this front does. With an address (`ray start --head` on one machine, `ray start
--address=<head>:6379` on the others, then `osd serve --replicas N --ray-address auto` on any of them) the actors are
detached: they outlive the front, and a front started again finds and serves them.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import ray

from osd.cluster.learner import LearnerNode
from osd.cluster.names import LEARNER, NAMESPACE, replica_name
from osd.cluster.pool import RemoteLearner, ReplicaPool
from osd.cluster.replica import ReplicaNode
from osd.errors import InvalidArgument
from osd.notice import say

log = logging.getLogger("osd.cluster")


@dataclasses.dataclass
class Cluster:
    pool: ReplicaPool
    learner: RemoteLearner | None
    ready_seconds: float  # until every replica answered (models loaded, calibrated)


def connect(address: str | None = None) -> float:
    """ray.init once (local when address is None) -> the seconds it took (0: already connected)."""
    if ray.is_initialized():
        return 0.0
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # shipped samples are fire-and-forget (counted instead)
    start = time.perf_counter()
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
    else:
        ray.init(num_cpus=os.cpu_count(), namespace=NAMESPACE, include_dashboard=False, log_to_driver=True)
    return time.perf_counter() - start


def start_cluster(models, spec, learn, replicas: int, address: str | None = None, calibrate: bool = True,
                  namespace: str = NAMESPACE) -> Cluster:
    """N replicas (each `models.threads` threads, or 1) and, with `learn`, one learner; waits until all answer."""
    if replicas < 1:
        raise InvalidArgument(f"replicas must be >= 1, got {replicas}")
    connect(address)
    threads = models.threads or 1  # each replica asks Ray for a CPU per thread
    have = ray.cluster_resources().get("CPU", 0)
    if replicas * threads > have:
        raise InvalidArgument(f"{replicas} replicas x {threads} CPUs need {replicas * threads} CPUs; the Ray cluster has "
                              f"{have:g}: give fewer --replicas or --threads, or add machines (`ray start --address`)")
    if learn is not None and learn.checkpoint_dir:  # the learner's working directory is Ray's, not ours
        learn = dataclasses.replace(learn, checkpoint_dir=os.path.abspath(learn.checkpoint_dir))
    models = dataclasses.replace(models, threads=threads)
    detached = address is not None
    common = dict(namespace=namespace, get_if_exists=True, max_restarts=-1, max_task_retries=0,
                  lifetime="detached" if detached else None)
    learner = None
    if learn is not None:  # first: a starting replica asks it for the newest version
        learner = ray.remote(LearnerNode).options(name=LEARNER, num_cpus=0, max_concurrency=4, **common).remote(
            models, learn, replicas, namespace)
    if learner is not None and models.draft_quantize == "auto":  # the kind the learner timed and will ship
        models = dataclasses.replace(models, draft_quantize=ray.get(learner.copy_kind.remote()))
    handles = [ray.remote(ReplicaNode).options(name=replica_name(i), num_cpus=threads, scheduling_strategy="SPREAD",
                                               **common).remote(i, models, spec, learn, namespace, calibrate)
               for i in range(replicas)]
    start = time.perf_counter()
    say(f"starting {replicas} replica(s){' and the learner' if learner else ''} on Ray "
        f"({'joined ' + address if address else 'local'}); each loads the models ...")
    ray.get([h.ready.remote() for h in handles] + ([learner.ready.remote()] if learner else []))
    ready = time.perf_counter() - start
    say(f"{replicas} replica(s) ready in {ready:.1f} s")
    pool = ReplicaPool(handles, learner, owns_cluster=not detached)
    remote = RemoteLearner(learner, pool, owns=not detached) if learner is not None else None
    return Cluster(pool, remote, ready)


def serve_cluster(models, spec, learn, settings, model_name: str, replicas: int, address: str | None = None) -> None:
    """`osd serve --replicas N`: the HTTP front on this (the main) thread, the model work in the replicas."""
    import uvicorn

    from osd.models.loading import load_tokenizer
    from osd.serve.app import create_app
    from osd.serve.settings import http_config

    tokenizer = load_tokenizer(models.target)
    cluster = start_cluster(models, spec, learn, replicas, address)
    app = create_app(None, tokenizer, model_name, learner=cluster.learner, settings=settings, pool=cluster.pool)
    uvicorn.Server(http_config(app, settings)).run()
