"""Replicas on Ray with one learner, on the tiny pair (conftest.save_tiny_pair), with ray.init(num_cpus=2) shared by
the module: greedy identity whichever replica serves, samples from every replica reach the learner, a published
version reaches both replicas, a bad version is refused, a replica / the learner / the front killed and restarted.
Ray is required here: if it cannot start, these tests fail with the reason (nothing is skipped)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import save_tiny_pair
from helpers import plain_greedy

import ray  # noqa: E402  (a dev dependency: missing, the module fails to import and its tests fail)
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError  # noqa: E402

from osd.cluster.launch import start_cluster  # noqa: E402
from osd.cluster.names import LEARNER, NAMESPACE, replica_name  # noqa: E402
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig  # noqa: E402
from osd.learn.online import LearnConfig  # noqa: E402
from osd.serve.app import create_app  # noqa: E402
from osd.serve.settings import ServeSettings  # noqa: E402
from osd.serve.threaded import serve_in_thread  # noqa: E402

# every position, the guard off (tested elsewhere), no automatic trigger: the tests publish with update_now
LEARN = dict(mode="all", every_requests=0, trainable="all", train_layers=0, guard=False, lr=1e-2, steps_per_update=4,
             batch_size=4, average=0.0)
PROMPTS = [[5, 9, 2, 7], [3, 3, 8], [11, 4, 6, 1, 2], [7, 7, 7, 2], [1, 2, 3, 4, 5, 6]]
N_NEW = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    save_tiny_pair(root)
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    models = ModelConfig(target=str(root / "target"), draft=str(root / "draft"), draft_quantize="none",
                         prepack_target=False, threads=1)
    spec = SpeculationConfig(k=3, adaptive=False, max_batch=2)
    learn = LearnConfig(**LEARN, checkpoint_dir=str(root / "ckpt"))
    made = start_cluster(models, spec, learn, replicas=2, calibrate=False)
    yield made, root, (models, spec, learn)
    ray.shutdown()


def sampling(n=N_NEW):
    return SamplingConfig(temperature=0.0, max_new_tokens=n)


async def _answer(pool, prompt, draft=None):
    job = pool.submit(prompt, sampling(), stream=True, draft=draft)
    texts = []
    while True:
        kind, payload = await job.next()
        if kind == "text":
            texts.append(payload)
            continue
        if kind == "error":
            raise payload
        return payload, texts


def answers(pool, prompts, draft=None):
    import asyncio

    async def run():
        return await asyncio.gather(*(_answer(pool, p, draft) for p in prompts))

    return asyncio.run(run())


def target_model(root):
    from osd.models.loading import load_model

    return load_model(str(root / "target"))


NOT_YET = (ActorUnavailableError, RayActorError, GetTimeoutError)  # an actor restarting, or slow to answer


def wait_for(what: str, predicate, timeout: float = 120.0, every: float = 0.05):
    """Poll until predicate() is truthy -> its value. An actor that is restarting or slow to answer counts as not yet
    (on a loaded machine a restart, or a call, can take a while). The deadline is generous: it only bounds a test
    that would otherwise hang, and its error says what was awaited and the last answer or error seen."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except NOT_YET as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:.0f} s: {what} (last: {str(last)[:300]})")
        time.sleep(every)


def replica_stats(i):
    return ray.get(ray.get_actor(replica_name(i), namespace=NAMESPACE).stats.remote(), timeout=30)


def settled(replicas=(0, 1)) -> int:
    """Wait until every replica and the learner answer (a killed one restarted, models loaded, the newest version
    fetched), and both replicas serve the learner's version -> that version."""
    learner = ray.get_actor(LEARNER, namespace=NAMESPACE)
    version = wait_for("the learner answering", lambda: [ray.get(learner.ready.remote(), timeout=30)])[0]
    wait_for(f"replicas {list(replicas)} answering, on the learner's version {version}",
             lambda: all(replica_stats(i)["version"] == version for i in replicas))
    return version


def test_greedy_identical_whichever_replica_and_samples_reach_the_learner(cluster):
    made, root, _ = cluster
    settled()
    target = target_model(root)
    results = answers(made.pool, PROMPTS * 2)  # 10 requests at once: both replicas take some
    for prompt, (result, texts) in zip(PROMPTS * 2, results):
        assert result.token_ids == plain_greedy(target, prompt, N_NEW)[: len(result.token_ids)]
        assert len(result.token_ids) == N_NEW or result.finish_reason == "stop"
        assert "".join(texts) == result.text
    learner = ray.get_actor(LEARNER, namespace=NAMESPACE)
    stats = wait_for("the learner holding the 10 requests' samples",
                     lambda: (s := ray.get(learner.stats.remote(), timeout=30)) and s["requests_received"] >= 10 and s)
    assert set(stats["samples_by_replica"]) == {"0", "1"}  # fed by every replica
    assert stats["sample_bytes_received"] > 0 and stats["samples_received"] >= 10


def test_a_published_version_reaches_both_replicas_and_a_bad_one_is_refused(cluster):
    made, root, _ = cluster
    before = settled()
    answers(made.pool, PROMPTS)  # something to train on
    learner = ray.get_actor(LEARNER, namespace=NAMESPACE)
    wait_for("the learner holding samples to train on",
             lambda: ray.get(learner.stats.remote(), timeout=30)["requests_received"] >= len(PROMPTS))
    report = ray.get(learner.update_now.remote())
    assert report["published"], report
    version = report["version"]
    assert version == before + 1
    wait_for(f"version {version} served by both replicas",
             lambda: all(replica_stats(i)["version"] == version for i in (0, 1)))
    for i in (0, 1):  # pushed, not fetched at a restart: the swap records the publish it followed
        swap = replica_stats(i)["last_swap"]
        assert swap["version"] == version and swap["error"] is None and swap["publish_to_swap_seconds"] >= 0
    # a version that does not fit is refused whole and reported; the replica serves on, on the version it had
    handle = ray.get_actor(replica_name(0), namespace=NAMESPACE)
    import numpy as np

    bad = {"model.layers.0.mlp.down_proj.weight": np.zeros((3, 3), dtype=np.float32)}
    state = ray.get(handle.swap.remote(version + 5, bad, time.time()))
    assert state["version"] == version and state["swap_failures"] == 1 and "refused" in state["last_swap"]["error"]
    nan = {name: np.full(a.shape, np.nan, dtype=np.float32) for name, a in _arrays(learner).items()}
    state = ray.get(handle.swap.remote(version + 6, nan, time.time()))
    assert state["version"] == version and state["swap_failures"] == 2
    old = ray.get(handle.swap.remote(version - 1, _arrays(learner), time.time()))
    assert old["version"] == version and old["swaps_ignored_old"] >= 1  # never back to an older version
    target = target_model(root)
    result, _ = answers(made.pool, PROMPTS[:1])[0]
    assert result.token_ids == plain_greedy(target, PROMPTS[0], N_NEW)[: len(result.token_ids)]
    assert result.draft[1] == version


def _arrays(learner):
    version, refs, _ = ray.get(learner.latest.remote())
    return ray.get(refs[0])


def test_a_killed_replica_restarts_on_the_newest_version_and_requests_go_on(cluster):
    made, root, _ = cluster
    version = settled()
    handle = ray.get_actor(replica_name(1), namespace=NAMESPACE)
    pid = ray.get(handle.pid.remote(), timeout=30)
    os.kill(pid, signal.SIGKILL)
    target = target_model(root)
    results = answers(made.pool, PROMPTS)  # every request answered (retried on replica 0 where 1 was gone)
    for prompt, (result, _) in zip(PROMPTS, results):
        assert result.token_ids == plain_greedy(target, prompt, N_NEW)[: len(result.token_ids)]
    state = wait_for("replica 1 restarted (a new process answering)", lambda: (s := replica_stats(1))["pid"] != pid and s)
    assert state["version"] == version  # it came back on the newest published draft


def test_the_learner_killed_resumes_from_its_checkpoint_and_replicas_keep_serving(cluster):
    made, root, _ = cluster
    settled()
    learner = ray.get_actor(LEARNER, namespace=NAMESPACE)
    answers(made.pool, PROMPTS)
    wait_for("the learner holding samples to train on",
             lambda: ray.get(learner.stats.remote(), timeout=30)["requests_received"] >= len(PROMPTS))
    report = ray.get(learner.update_now.remote())
    assert report["published"]
    version = report["version"]
    assert (root / "ckpt").exists()
    pid = ray.get(learner.pid.remote(), timeout=30)
    os.kill(pid, signal.SIGKILL)
    target = target_model(root)
    results = answers(made.pool, PROMPTS[:2])  # the replicas serve on while the learner is down
    for prompt, (result, _) in zip(PROMPTS, results):
        assert result.token_ids == plain_greedy(target, prompt, N_NEW)[: len(result.token_ids)]
        assert result.draft[1] == version
    wait_for("the learner restarted (a new process) on its checkpoint's version",
             lambda: ray.get(learner.pid.remote(), timeout=30) != pid and ray.get(learner.ready.remote(), timeout=30)
             == version)
    answers(made.pool, PROMPTS)
    wait_for("the restarted learner holding new samples",
             lambda: ray.get(learner.stats.remote(), timeout=30)["requests_received"] >= 1)
    report = ray.get(learner.update_now.remote())
    assert report["published"] and report["version"] == version + 1  # onward from the checkpoint's version
    wait_for(f"version {version + 1} served by both replicas",
             lambda: all(replica_stats(i)["version"] == version + 1 for i in (0, 1)))


def test_http_front_restarted_finds_the_cluster_pins_and_aggregates_metrics(cluster):
    made, root, (models, spec, learn) = cluster
    version = settled()
    again = start_cluster(models, spec, learn, replicas=2, calibrate=False)  # a new front: the same named actors
    from osd.models.loading import load_tokenizer

    app = create_app(None, load_tokenizer(models.target), "tiny", learner=again.learner, settings=ServeSettings(),
                     pool=again.pool)
    import httpx

    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        wait_for("the new front's metrics holding both replicas' draft versions",
                 lambda: all(f'osd_replica_draft_version{{replica="{i}"}}' in http.get("/metrics").text
                             for i in "01"))
        body = {"model": "tiny", "prompt": "ab", "max_tokens": 6, "temperature": 0, "osd": {"draft": "default"}}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["osd"]["draft_version"] == version
        r = http.post("/v1/completions", json={**body, "osd": {"draft": "nope"}})
        assert r.status_code == 404 and r.json()["error"]["code"] == "draft_not_found"
        metrics = http.get("/metrics").text
        for i in ("0", "1"):
            assert f'osd_replica_draft_version{{replica="{i}"}} {float(version)}' in metrics
        assert 'replica="learner"' in metrics and "osd_cluster_samples_received_total" in metrics
        assert http.get("/v1/osd/learner").json()["version"] == version
        assert http.get("/health").json()["status"] == "ok"


def test_osd_serve_without_replicas_never_imports_ray():
    code = ("import sys, osd.cli, osd.serve.cli, osd.serve.app, osd.build, osd.serve.worker; "
            "sys.exit(1 if any(m == 'ray' or m.startswith('ray.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
