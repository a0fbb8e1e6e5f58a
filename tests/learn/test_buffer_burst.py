"""Samples from every request are kept until used or aged out (learn/buffer.py keep_unused): a burst of requests
larger than the buffer's capacity, and than what one update takes in, loses none that has not aged out."""
import random
import time
from types import SimpleNamespace

import torch
from conftest import tiny_qwen2

from osd.engine import StepRecord
from osd.learn.buffer import ReplayBuffer, fresh_first, item_from_step
from osd.learn.online import LearnConfig, OnlineLearner

PUBLISH = lambda master, version=None: SimpleNamespace(version=1)


def _items(n, now=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(n):
        context = torch.randint(2, 40, (6,), generator=g).tolist()
        step = StepRecord(f"r{r}", ("draft", 0), context, [5, 7, 9], 1, 0, torch.randn(4, 48, generator=g) * 3, None,
                          [], 0.0, 0.0, 0.0)
        out.append(item_from_step(step, "all", top_k=8, now=now))  # 2 positions each
    return out


def test_a_burst_past_capacity_keeps_every_unused_sample_until_it_ages_out():
    now = [0.0]
    buffer = ReplayBuffer(capacity=20, clock=lambda: now[0], keep_unused=60.0)
    burst = _items(30)  # 60 positions: three times the capacity
    for item in burst:
        buffer.add(item)
    assert len(buffer) == 60 and buffer.evicted == 0 and buffer.evicted_unused == 0
    for item in burst[:20]:  # an update used the oldest 20
        item.used += 1
    buffer.add(_items(1, seed=1)[0])
    assert buffer.evicted_unused == 0 and all(not it.used for it in buffer.snapshot())  # used ones went first
    now[0] = 61.0  # the rest ages out: plain FIFO again
    buffer.add(_items(1, now=61.0, seed=2)[0])
    assert len(buffer) <= 20 and buffer.evicted_unused > 0
    fifo = ReplayBuffer(capacity=20)  # without keep_unused: the burst's oldest samples are lost unused
    for item in _items(30):
        fifo.add(item)
    assert len(fifo) == 20 and fifo.evicted_unused == 40


def test_unused_items_are_kept_only_up_to_the_hard_cap():
    buffer = ReplayBuffer(capacity=10, clock=lambda: 0.0, keep_unused=60.0, hard_cap=30)
    for item in _items(40):
        buffer.add(item)
    assert len(buffer) == 30 and buffer.evicted_unused == 50


def test_batches_take_unused_samples_first_oldest_first():
    items = _items(10)
    for it in items[:4]:
        it.used = 1
    batch = fresh_first(random.Random(0), items, 8)
    assert batch[:6] == items[4:] and len({id(b) for b in batch}) == 8


def test_the_background_learner_uses_every_sample_of_a_burst():
    """A burst of 40 requests (80 positions, capacity 24): two updates of 5 steps x 8 items take in every one."""
    config = LearnConfig(guard=False, every_requests=0, batch_size=8, steps_per_update=5, lr=1e-2, train_layers=0,
                         capacity=24, schedule="background", rehearsal=0.0)
    learner = OnlineLearner(tiny_qwen2(seed=1, layers=1), PUBLISH, config)
    burst = _items(40, now=time.monotonic())
    for item in burst:
        learner.observe_item(item)
    assert learner.buffer.evicted_unused == 0
    learner.update()
    learner.update()
    assert all(item.used for item in burst) and learner.stats()["buffer_evicted_unused"] == 0


def test_interleaved_steps_of_batched_requests_merge_per_request():
    """Under continuous batching the steps of several requests interleave; each request still ends as one item (one
    draft forward for all its positions), as when requests ran one at a time."""
    g = torch.Generator().manual_seed(0)
    buffer = ReplayBuffer(capacity=1000)
    contexts = {r: torch.randint(2, 40, (6,), generator=g).tolist() for r in ("a", "b", "c")}
    for _ in range(4):  # four steps of each request, interleaved a, b, c, a, b, c, ...
        for r, context in contexts.items():
            step = StepRecord(r, ("draft", 0), list(context), [5, 7], 2, 0, torch.randn(3, 48, generator=g), None,
                              [], 0.0, 0.0, 0.0)
            buffer.add(item_from_step(step, "all", top_k=8))  # all accepted: 3 positions
            context += [5, 7, 9]  # the step's accepted tokens and its bonus token
    items = buffer.snapshot()
    assert sorted(it.request_id for it in items) == ["a", "b", "c"] and len(buffer) == 4 * 3 * 3
    assert all(len(it.positions) == 12 for it in items)


def test_a_busy_servers_learner_gets_a_sample_from_every_step_even_where_nothing_was_proposed():
    """Under load the goodput policy often picks k = 0 (a live code run at 0.8 of capacity: mean k 0.2-0.7); the
    serving recipe learns from those steps' one verified position too, or a busy server's draft would get almost no
    data (the "mismatch" mode sees nothing at a step without a rejection)."""
    g = torch.Generator().manual_seed(0)
    k0 = StepRecord("r", ("draft", 0), [3, 4, 5], [], 0, 7, torch.randn(1, 48, generator=g), None, [], 0.0, 0.0, 0.0)
    serving = LearnConfig.serving()
    item = item_from_step(k0, serving.mode, serving.top_k)
    assert item is not None and item.positions == [3] and item.target.ids.shape[0] == 1
    assert item_from_step(k0, "mismatch", serving.top_k) is None
