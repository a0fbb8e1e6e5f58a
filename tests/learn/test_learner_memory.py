"""The learner's memory: its fixed part taken at start (learn/memory.py), the rest accounted and bounded."""
import copy
from types import SimpleNamespace

import torch
from conftest import tiny_qwen2

from osd.engine import StepRecord
from osd.learn.buffer import item_from_step
from osd.learn.drift import VersionStore
from osd.learn.memory import optimizer_state_bytes, tensor_bytes
from osd.learn.online import LearnConfig, OnlineLearner

PUBLISH = lambda master, version=None: SimpleNamespace(version=1)


def _items(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(n):
        context = torch.randint(2, 40, (6,), generator=g).tolist()
        step = StepRecord(f"r{r}", ("draft", 0), context, [5, 7, 9], 1, 0, torch.randn(4, 48, generator=g) * 3, None,
                          [], 0.0, 0.0, 0.0)
        out.append(item_from_step(step, "all", top_k=8))
    return out


def _learner(**kw):
    config = LearnConfig(guard=False, every_requests=0, batch_size=4, steps_per_update=3, lr=1e-2, train_layers=0, **kw)
    return OnlineLearner(tiny_qwen2(seed=1, layers=1), PUBLISH, config)


def test_reserved_optimizer_state_trains_bit_identically_to_torchs_lazy_one():
    """The moments exist before the first step (zeros, step 0) and the weights after an update equal those of an
    optimizer that allocated its state lazily: reserving changes memory timing, not training."""
    reserved, lazy = _learner(), _learner()
    trainable = tensor_bytes(reserved.params)
    assert optimizer_state_bytes(reserved.optimizer) >= 2 * trainable  # before any step
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in reserved.optimizer.state.values())
    lazy.optimizer.state.clear()
    for learner in (reserved, lazy):
        for it in _items(6):
            learner.observe_item(copy.deepcopy(it))
        assert learner.update("test")["published"]
    assert lazy.counters["optimizer_steps"] == reserved.counters["optimizer_steps"] == 3
    assert all(torch.equal(a, b) for a, b in zip(reserved.params, lazy.params))
    assert all(float(s["step"]) == 3 for s in reserved.optimizer.state.values())


def test_memory_is_reported_fixed_part_at_start_and_buffers_bounded():
    learner = _learner(capacity=12, guard_capacity=8, rehearsal_capacity=4)
    start = learner.stats()
    trainable = tensor_bytes(learner.params)
    assert start["memory_trainable_bytes"] == trainable > 0
    assert start["memory_optimizer_bytes"] >= 2 * trainable and start["memory_buffers_bytes"] == 0
    for it in _items(40):
        learner.observe_item(it, copy.deepcopy(it))
    full = learner.stats()["memory_buffers_bytes"]
    assert full > 0 and len(learner.buffer) <= 12
    for it in _items(40, seed=1):
        learner.observe_item(it, copy.deepcopy(it))
    assert learner.stats()["memory_buffers_bytes"] <= full * 1.1  # bounded by the capacities (buffer, guard, rehearsal), not the traffic


def test_version_store_keeps_the_best_version_in_one_preallocated_slot():
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
    store = VersionStore(params)
    assert store.bytes() == 2 * tensor_bytes(params)  # base + best slot, at start
    slot = store._best_slot
    with torch.no_grad():
        params[0].add_(1.0)
    store.remember_best(3)
    assert store.best["weights"] is slot and torch.equal(slot[0], params[0])
    with torch.no_grad():
        params[0].add_(1.0)
    store.remember_best(4)
    assert store.best["weights"] is slot and torch.equal(slot[0], params[0]) and store.best["version"] == 4
    saved = copy.deepcopy(store.state_dict())
    other = VersionStore(params)
    other.load_state_dict(saved)
    assert other.best["version"] == 4 and other.best["weights"] is other._best_slot
    assert torch.equal(other._best_slot[0], params[0])
