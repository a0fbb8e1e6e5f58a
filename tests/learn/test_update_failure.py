"""A learner update cut short by an exception never leaves the master half-updated (learn/restore.py).

After real optimizer steps have changed the master, an exception puts back its trainable weights and the
optimizer's moments bitwise, is counted in update_errors, leaves the served draft as it was, and the next update
trains and publishes. A failure after this update has published returns the master to what serves, not further.
"""
import copy

import pytest
import torch
from conftest import tiny_qwen2
from helpers import make_engine

from osd.config import SamplingConfig
from osd.drafts import weights_fingerprint
from osd.learn.online import LearnConfig, OnlineLearner

STREAM = [[5 + i % 7, 9 + i % 5, 20 + i % 3] for i in range(4)]


def _learner(target_model, tokenizer, **cfg):
    draft = tiny_qwen2(seed=1, layers=1)
    engine, registry = make_engine(target_model, copy.deepcopy(draft), tokenizer, k=3)
    publish = lambda master, version=None: registry.publish("draft", copy.deepcopy(master).eval(), None, version)
    config = LearnConfig(mode="all", every_requests=0, guard=False, lr=1e-2, steps_per_update=4, **cfg)
    learner = OnlineLearner(draft, publish, config).attach(engine)
    for prompt in STREAM:  # fill the buffer (every_requests = 0: no update of its own)
        engine.generate(prompt, SamplingConfig(max_new_tokens=12))
    return learner, registry


def _weights(learner):
    return [p.detach().clone() for p in learner.params]


def _optimizer_tensors(learner):
    return {(i, key): value.clone() for i, state in learner.optimizer.state_dict()["state"].items()
            for key, value in state.items()}


def _bitwise_equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("trainable", ["all", "lora"])
def test_an_exception_midway_restores_the_master_and_the_next_update_publishes(target_model, tokenizer, trainable):
    learner, registry = _learner(target_model, tokenizer, trainable=trainable)
    assert learner.update()["published"]  # version 1, and Adam moments to restore
    weights, moments = _weights(learner), _optimizer_tensors(learner)
    served = registry.get("draft")
    served_fingerprint = weights_fingerprint(served.model)
    real_step, seen = learner.optimizer.step, {}

    def step_then_fail(*args, **kwargs):
        real_step(*args, **kwargs)
        seen["steps"] = seen.get("steps", 0) + 1
        if seen["steps"] == 2:  # two real steps have changed the weights and the moments
            seen["changed"] = not _bitwise_equal(_weights(learner), weights)
            raise RuntimeError("simulated failure midway")

    learner.optimizer.step = step_then_fail
    with pytest.raises(RuntimeError, match="simulated failure midway"):
        learner.update()
    assert seen["changed"]  # the failure came after the master had moved
    assert _bitwise_equal(_weights(learner), weights)
    after = _optimizer_tensors(learner)
    assert after.keys() == moments.keys() and all(torch.equal(after[k], moments[k]) for k in moments)
    assert all(p.grad is None for p in learner.params) and not learner.master.training
    assert registry.get("draft") is served and weights_fingerprint(served.model) == served_fingerprint
    stats = learner.stats()
    assert stats["update_errors"] == 1 and stats["updates_rejected"] == 0 and stats["updates_published"] == 1
    assert stats["version"] == 1 and "simulated failure" in learner.last_update["error"]

    learner.optimizer.step = real_step
    report = learner.update()
    assert report["published"] and registry.get("draft").version == 2 and learner.counters["update_errors"] == 1
    assert weights_fingerprint(registry.get("draft").model) != served_fingerprint


def test_a_failure_after_publishing_keeps_the_master_equal_to_what_serves(target_model, tokenizer, tmp_path):
    learner, registry = _learner(target_model, tokenizer, trainable="all", checkpoint_dir=str(tmp_path / "ckpt"))
    before = _weights(learner)

    def failing_save():
        raise OSError("simulated full disk")

    learner.save = failing_save  # runs after the publish
    with pytest.raises(OSError, match="full disk"):
        learner.update()
    served = registry.get("draft")
    assert served.version == 1 and learner.version == 1 and learner.counters["update_errors"] == 1
    assert not _bitwise_equal(_weights(learner), before)  # not rolled back past the published version
    assert _bitwise_equal(_weights(learner), [p for p in served.model.parameters()])


def test_a_step_that_leaves_non_finite_weights_is_rejected_and_leaves_no_trace(target_model, tokenizer):
    """Finite loss and gradients, yet a step that writes inf into a weight (an overflow in the optimizer): the update
    is rejected as "non-finite weights", the master and the moments are back as they were, what serves is untouched."""
    learner, registry = _learner(target_model, tokenizer)
    assert learner.update()["published"]
    weights, moments = _weights(learner), _optimizer_tensors(learner)
    served = registry.get("draft")
    real_step = learner.optimizer.step

    def step_into_inf(*args, **kwargs):
        real_step(*args, **kwargs)
        with torch.no_grad():
            learner.params[0].view(-1)[0] = float("inf")

    learner.optimizer.step = step_into_inf
    report = learner.update()
    assert not report["published"] and report["rejected_because"] == "non-finite weights" and report["losses"]
    assert _bitwise_equal(_weights(learner), weights)
    after = _optimizer_tensors(learner)
    assert all(torch.equal(after[k], moments[k]) for k in moments)
    assert registry.get("draft") is served and learner.stats()["updates_rejected"] == 1
