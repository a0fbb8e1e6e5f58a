"""A cluster whose drafts serve from Q4 copies (--draft-quantize q4, and auto, the default, timed once by the
learner): the replicas serve the kind the learner builds, a published version's kernel blocks reach them and are
served, greedy output stays the target's. Its own Ray session (ray.init(num_cpus=2)), one replica, after
test_cluster.py's."""
from __future__ import annotations

import pytest
from conftest import require_q4, save_tiny_pair, tiny_qwen2
from helpers import plain_greedy

import ray  # noqa: E402  (a dev dependency: missing, the module fails to import and its tests fail)

from osd.cluster.launch import start_cluster  # noqa: E402
from osd.cluster.names import LEARNER, NAMESPACE, replica_name  # noqa: E402
from osd.config import ModelConfig, SpeculationConfig  # noqa: E402
from osd.learn.online import LearnConfig  # noqa: E402
from tests.cluster.test_cluster import LEARN, N_NEW, PROMPTS, answers, target_model, wait_for  # noqa: E402


@pytest.fixture(scope="module", params=["q4", "auto"])
def cluster(request, tmp_path_factory):
    require_q4()
    root = tmp_path_factory.mktemp("pair")
    save_tiny_pair(root)
    tiny_qwen2(seed=1, layers=2, hidden=64).save_pretrained(root / "draft")  # head dim 16: the Q4 copy takes it
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    models = ModelConfig(target=str(root / "target"), draft=str(root / "draft"), draft_quantize=request.param,
                         prepack_target=False, threads=1)
    learn = LearnConfig(**LEARN, checkpoint_dir=str(root / "ckpt"))
    made = start_cluster(models, SpeculationConfig(k=3, adaptive=False, max_batch=2), learn, replicas=1, calibrate=False)
    yield made, root, request.param
    ray.shutdown()


def test_replicas_serve_the_learners_copy_and_take_its_versions(cluster):
    made, root, quantize = cluster
    learner = ray.get_actor(LEARNER, namespace=NAMESPACE)
    replica = ray.get_actor(replica_name(0), namespace=NAMESPACE)
    kind = ray.get(learner.copy_kind.remote())
    assert kind == "q4" if quantize == "q4" else kind in ("q4", "int8")  # auto: whichever the learner timed faster
    assert ray.get(replica.stats.remote())["draft_copy"] == kind  # the replica serves what it will be shipped
    assert ray.get(learner.stats.remote())["draft_copy"] == kind
    target = target_model(root)
    for prompt, (result, _) in zip(PROMPTS, answers(made.pool, PROMPTS)):
        assert result.token_ids == plain_greedy(target, prompt, N_NEW)[: len(result.token_ids)]
    report = ray.get(learner.update_now.remote())
    assert report["published"], report
    version = report["version"]
    _, refs, _ = ray.get(learner.latest.remote())
    arrays = ray.get(refs[0])
    if kind == "q4":  # whole changed layers of kernel blocks, not float tensors
        assert any(name.startswith("matrices.blk.") and name.endswith(".qs") for name in arrays)
    stats = wait_for(f"version {version} served by the replica",
                     lambda: (s := ray.get(replica.stats.remote(), timeout=30)) and s["version"] == version and s)
    assert stats["swaps"] >= 1 and stats["swap_failures"] == 0 and stats["last_swap"]["error"] is None
    for prompt, (result, _) in zip(PROMPTS, answers(made.pool, PROMPTS)):
        assert result.token_ids == plain_greedy(target, prompt, N_NEW)[: len(result.token_ids)]
        assert result.draft[1] == version  # served by the shipped version
