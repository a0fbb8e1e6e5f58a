"""The drift guard (learn/online.py, learn/drift.py): small losses that each pass the per-update guard add up; the
learner compares the serving draft with the never-trained base on held-out requests and rolls back or resets."""
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import EOS, tiny_qwen2

import osd.learn.online as online
from osd.distill.cache import DecodeSettings, TargetCache
from osd.distill.evaluate import sample_item
from osd.distill.target_outputs import target_samples
from osd.learn.batch import acceptance_on
from osd.learn.guard import paired_z
from osd.learn.online import LearnConfig, OnlineLearner
from osd.serve.prom import learner_families

rng = random.Random(3)
PROMPTS = [[rng.randrange(2, 40) for _ in range(rng.randrange(2, 5))] for _ in range(80)]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The target's outputs (task A: the one served) and another model's on the same prompts (task B: harmful)."""
    settings = DecodeSettings(max_new_tokens=12, top_k=16)
    out = []
    for seed in (0, 5):
        cache = TargetCache(tmp_path_factory.mktemp(f"t{seed}"), f"t{seed}")
        out.append(target_samples(cache, tiny_qwen2(seed=seed), PROMPTS, settings, {EOS}, batch_size=40))
    return out


def base_draft():
    """The target with a noisy LM head: agrees on ~0.7 of task A's tokens, so learning can help and can hurt."""
    draft = tiny_qwen2(seed=0)
    with torch.no_grad():
        draft.lm_head.weight.add_(0.05 * torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(3)))
    return draft


def item(sample, request: int):
    it = sample_item(sample)
    it.request_id = f"r{request}"
    return it


def stream(tasks, train_task, drift_guard=True, requests=60, average=0.0):
    """Requests 0..59; the guard always judges task A (what is served); the learner trains on train_task(i)'s output.
    The per-update guard is switched off in effect (guard_z = 50): only the drift guard can stop a slide."""
    published = {0: None}

    def publish(master, version=None):
        version = max(published) + 1 if version is None else version
        published[version] = [p.detach().clone() for p in master.parameters()]
        return SimpleNamespace(version=version)

    config = LearnConfig(every_requests=4, steps_per_update=4, batch_size=4, lr=1e-3, train_layers=0, guard=True,
                         guard_holdout=0.3, guard_z=50.0, drift_guard=drift_guard, average=average)
    learner = OnlineLearner(base_draft(), publish, config)
    for i in range(requests):
        learner.observe_item(item(tasks[train_task(i)][i], i), item(tasks[0][i], i))
        learner.after_request()
    return learner, published


def unseen_z(tasks, learner) -> float:
    """The learned draft against the base on 20 requests of task A that nothing saw: paired z."""
    unseen = [item(s, 100 + j) for j, s in enumerate(tasks[0][60:])]
    return paired_z(acceptance_on(base_draft(), unseen)["correct"], acceptance_on(learner.master, unseen)["correct"])


def actions(learner) -> list[str]:
    return [(u.get("vs_base") or {}).get("action") for u in learner.history]


def test_a_helpful_stream_is_never_rolled_back_and_learns(tasks):
    learner, _ = stream(tasks, lambda i: 0)
    assert learner.counters["rollbacks"] == learner.counters["resets"] == 0 and set(actions(learner)) == {"keep"}
    assert unseen_z(tasks, learner) > 1.64  # it did learn task A


def test_training_on_another_task_is_reset_to_the_base_and_never_ends_below_it(tasks):
    learner, published = stream(tasks, lambda i: 1)
    assert learner.counters["resets"] + learner.counters["rollbacks"] >= 5
    reset = next(u["vs_base"] for u in learner.history if u["vs_base"]["action"] == "reset")
    assert reset["z"] < -1.64 and reset["restored_version"] == 0
    base = list(base_draft().parameters())
    assert all(torch.equal(a, b) for a, b in zip(published[reset["published_version"]], base))  # the base, published
    assert unseen_z(tasks, learner) > -1.64  # never significantly below the control on unseen requests
    unguarded, _ = stream(tasks, lambda i: 1, drift_guard=False)  # the same stream without the drift guard slides
    assert unguarded.counters["resets"] == unguarded.counters["rollbacks"] == 0 and unseen_z(tasks, unguarded) < -1.64


def test_a_slide_after_learning_rolls_back_to_the_best_version(tasks):
    learner, published = stream(tasks, lambda i: 0 if i < 24 else 1, requests=80)  # learns A, then slides on B
    assert actions(learner)[:6] == ["keep"] * 6 and learner.counters["rollbacks"] >= 1
    rollback = next(u["vs_base"] for u in learner.history if u["vs_base"]["action"] == "rollback")
    best, now = rollback["restored_version"], rollback["published_version"]
    assert 0 < best < now and all(torch.equal(a, b) for a, b in zip(published[best], published[now]))
    stats = learner.stats()
    assert stats["rollbacks"] == learner.counters["rollbacks"] and stats["resets"] == learner.counters["resets"]
    exposed = {sample.name: sample.value for family in learner_families(stats) for sample in family.samples}
    assert exposed["osd_learner_rollbacks_total"] == stats["rollbacks"]  # what /metrics shows


def test_held_out_requests_were_never_trained_on(tasks, monkeypatch):
    trained, violations = set(), []
    items_loss, acceptance = online.items_loss, online.acceptance_on

    def record_training(model, items, *args, **kw):
        trained.update(it.request_id for it in items)
        return items_loss(model, items, *args, **kw)

    def record_holdout(model, items, *args, **kw):
        violations.extend(it.request_id for it in items if it.request_id in trained)
        return acceptance(model, items, *args, **kw)

    monkeypatch.setattr(online, "items_loss", record_training)
    monkeypatch.setattr(online, "acceptance_on", record_holdout)
    learner, _ = stream(tasks, lambda i: 0, requests=40)
    assert trained and learner.counters["updates_published"] == 10 and violations == []
