"""Residual drafts (learn/residual.py): a follower is its leader plus its own optimizer steps."""
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import EOS, tiny_qwen2

from osd.distill.cache import DecodeSettings, TargetCache
from osd.distill.evaluate import sample_item
from osd.distill.target_outputs import target_samples
from osd.learn.online import LearnConfig, OnlineLearner
from osd.learn.residual import Residuals, add_difference

rng = random.Random(5)
PROMPTS = [[rng.randrange(2, 40) for _ in range(rng.randrange(2, 5))] for _ in range(24)]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Two targets' outputs on the same prompts: what the leader learns (A) and what the follower learns (B)."""
    settings, out = DecodeSettings(max_new_tokens=8, top_k=16), []
    for seed in (0, 5):
        cache = TargetCache(tmp_path_factory.mktemp(f"t{seed}"), f"t{seed}")
        out.append(target_samples(cache, tiny_qwen2(seed=seed), PROMPTS, settings, {EOS}, batch_size=24))
    return out


def learner(average=0.0, drift_guard=False):
    publish = lambda master, version=None: SimpleNamespace(version=0 if version is None else version)
    config = LearnConfig(every_requests=10_000, steps_per_update=3, batch_size=4, lr=1e-2, train_layers=1,
                         guard=drift_guard, drift_guard=drift_guard, average=average)
    return OnlineLearner(tiny_qwen2(seed=1, layers=2), publish, config)


def learn(model, samples, start):
    for j, s in enumerate(samples):
        it = sample_item(s)
        it.request_id = f"r{start + j}"
        model.observe_item(it, it)
    model.update()


def copies(tensors):
    return [t.detach().clone() for t in tensors]


@pytest.mark.parametrize("average", [0.0, 0.9])
def test_a_follower_is_its_leader_plus_its_own_steps(tasks, average):
    leader, follower = learner(average), learner(average)
    start = copies(follower.weights())
    residuals = Residuals(leader)
    learn(follower, tasks[1][:12], 0)  # the follower's own steps, on its traffic
    own = [w - s for w, s in zip(follower.weights(), start)]
    assert any(d.abs().max() > 0 for d in own)
    learn(leader, tasks[0][:12], 100)
    assert residuals.sync([follower])
    for w, lead, d in zip(follower.weights(), leader.weights(), own):  # the average and the trajectory alike
        assert torch.allclose(w, lead + d, atol=1e-6)
    moved = copies(follower.weights())
    assert not residuals.sync([follower])  # nothing new from the leader: nothing moves
    assert all(torch.equal(a, b) for a, b in zip(moved, follower.weights()))
    learn(leader, tasks[0][12:], 200)  # only the change since the last sync is carried over
    assert residuals.sync([follower])
    for w, lead, d in zip(follower.weights(), leader.weights(), own):
        assert torch.allclose(w, lead + d, atol=1e-6)


def test_the_drift_guard_of_a_follower_resets_it_to_the_leader_not_to_the_untrained_draft(tasks):
    leader, follower = learner(drift_guard=True), learner(drift_guard=True)
    untrained = copies(follower.params)
    residuals = Residuals(leader)
    learn(follower, tasks[1][:12], 0)
    learn(leader, tasks[0][:12], 100)
    residuals.sync([follower])
    for base, lead in zip(follower.versions.base, leader.params):
        assert torch.allclose(base, lead, atol=1e-6)
    follower.versions.restore("reset")
    assert all(torch.allclose(p, lead, atol=1e-6) for p, lead in zip(follower.params, leader.params))
    assert any(not torch.allclose(p, u) for p, u in zip(follower.params, untrained))


def test_add_difference_refuses_mismatched_weights():
    with pytest.raises(ValueError):
        add_difference([torch.zeros(2)], [torch.zeros(3)], [torch.zeros(3)])
