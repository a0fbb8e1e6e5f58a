"""Rehearsal against forgetting (learn/rehearsal.py): a uniform sample of evicted traffic, mixed into batches."""
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_qwen2

from osd.engine import StepRecord
from osd.errors import InvalidArgument
from osd.learn.buffer import item_from_step
from osd.learn.online import LearnConfig, OnlineLearner
from osd.learn.rehearsal import Reservoir, Sweeps, history_share, mixed_batch


def test_reservoir_keeps_a_uniform_sample_of_everything_offered():
    """Each of 400 offered items is kept with probability 40 / 400, early ones as often as late ones (a reservoir
    that kept the first or the last items, or replaced too often, fails): 2,000 seeded runs, binomial bounds."""
    kept_first, kept_last, runs = 0, 0, 2000
    for seed in range(runs):
        reservoir = Reservoir(40, seed)
        for i in range(400):
            reservoir.offer(i)
        held = reservoir.snapshot()
        assert len(held) == len(reservoir) == 40 and len(set(held)) == 40 and reservoir.offered == 400
        kept_first += sum(1 for i in held if i < 100)
        kept_last += sum(1 for i in held if i >= 300)
    expected, sd = runs * 10, (runs * 100 * 0.1 * 0.9) ** 0.5  # 100 items per quarter, each kept w.p. 0.1
    assert abs(kept_first - expected) < 5 * sd and abs(kept_last - expected) < 5 * sd


def test_reservoir_holds_everything_until_full():
    reservoir = Reservoir(5, 0)
    for i in range(3):
        reservoir.offer(i)
    assert reservoir.snapshot() == [0, 1, 2]


def test_mixed_batch_draws_its_share_from_older_items():
    rng, recent, older = random.Random(0), [("new", i) for i in range(20)], [("old", i) for i in range(20)]
    batch = mixed_batch(rng, recent, older, 8, 0.25)
    assert len(batch) == len(set(batch)) == 8 and sum(kind == "old" for kind, _ in batch) == 2
    assert all(kind == "new" for kind, _ in mixed_batch(rng, recent, older, 8, 0.0))
    assert sum(kind == "old" for kind, _ in mixed_batch(rng, recent, older[:1], 8, 0.5)) == 1  # as many as there are
    assert sum(kind == "old" for kind, _ in mixed_batch(rng, recent[:3], older, 8, 0.25)) == 5  # too few recent: filled
    assert len(mixed_batch(rng, recent, [], 8, 0.5)) == 8


def test_history_share_makes_every_item_seen_equally_likely():
    assert history_share(0, 10, 0.9) == 0.0 and history_share(0, 0, 0.9) == 0.0
    assert history_share(30, 10, 0.9) == 0.75  # 30 older items, 10 recent: 3 in 4 draws from the older ones
    assert history_share(990, 10, 0.9) == 0.9  # capped
    # drawn with that share, an older item (1 of 30, share 0.75) and a recent one (1 of 10, share 0.25) are as likely
    assert history_share(30, 10, 1.0) / 30 == (1 - history_share(30, 10, 1.0)) / 10


def test_stochastic_mixed_batch_meets_a_share_between_multiples_of_one_over_the_batch():
    """A share of 0.3 with batches of 4: rounding always takes 1 older item (0.25); drawn per slot, 0.3 on average."""
    recent, older = [("new", i) for i in range(50)], [("old", i) for i in range(50)]
    rng = random.Random(0)
    assert {sum(k == "old" for k, _ in mixed_batch(rng, recent, older, 4, 0.3)) for _ in range(50)} == {1}
    counts = [sum(k == "old" for k, _ in mixed_batch(rng, recent, older, 4, 0.3, stochastic=True)) for _ in range(4000)]
    assert abs(sum(counts) / (4 * 4000) - 0.3) < 0.015 and len(set(counts)) > 2
    assert all(len(mixed_batch(rng, recent, older, 4, 0.3, stochastic=True)) == 4 for _ in range(20))


def _item(request: int, logits):
    context = [1 + request % 50, 2 + request % 40]  # distinct contexts: one item per request, none merged
    step = StepRecord(f"r{request}", ("draft", 0), context, [9, 9], 0, 0, logits, None, [], 0.0, 0.0, 0.0)
    return item_from_step(step, "all", top_k=8)


def _batches_after_12_requests(**learn) -> tuple[OnlineLearner, list[list[str]]]:
    """A learner whose FIFO keeps the last 4 of 12 one-position requests, after one update: the request ids of
    each batch it trained on (no real step is taken)."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    config = LearnConfig(**{"capacity": 4, "batch_size": 4, "guard": False, "every_requests": 0,
                            "rehearsal_capacity": 16, "train_layers": 0, **learn})
    learner = OnlineLearner(tiny_qwen2(seed=1, layers=1), lambda master, version=None: SimpleNamespace(version=1),
                            config)
    batches = []
    learner._accumulate_gradients = lambda batch: batches.append([it.request_id for it in batch]) or 0.0
    for r in range(12):
        learner.observe_item(_item(r, logits))
    learner.update("test")
    return learner, batches


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_learner_trains_on_evicted_traffic_only_with_rehearsal(share):
    """A FIFO of 4 positions keeps the last 4 requests; with rehearsal the batches also draw from the earlier ones
    it evicted (half of each batch), without it never."""
    learner, batches = _batches_after_12_requests(steps_per_update=6, rehearsal=share)
    recent = {f"r{r}" for r in range(8, 12)}
    assert {it.request_id for it in learner.buffer.snapshot()} == recent
    assert len(batches) == 6
    evicted = [[rid for rid in b if rid not in recent] for b in batches]
    if share:
        assert learner.stats()["rehearsal_items"] == 8 and all(len(e) == 2 for e in evicted)
        assert set().union(*evicted) <= {f"r{r}" for r in range(8)}
    else:
        assert learner.reservoir is None and learner.stats()["rehearsal_items"] == 0 and not any(evicted)


def test_rehearsal_share_is_checked():
    with pytest.raises(InvalidArgument):
        LearnConfig(rehearsal=1.5)


def test_uniform_rehearsal_draws_older_traffic_by_its_share_of_all_traffic():
    """12 requests, the FIFO keeps the last 4, 8 were evicted: with rehearsal_uniform each batch slot is an older
    item with probability 8 / 12 (not the fixed 0.5), so old and recent requests are drawn equally often per item."""
    _, batches = _batches_after_12_requests(steps_per_update=300, rehearsal=0.9, rehearsal_uniform=True)
    recent = {f"r{r}" for r in range(8, 12)}
    old = sum(rid not in recent for b in batches for rid in b) / sum(len(b) for b in batches)
    assert abs(old - 8 / 12) < 0.04  # fixed rehearsal would give 0.9 x 4 = 3.6 -> 4 of 4 (rounded), i.e. 1.0


def test_sweeps_draw_every_item_once_before_any_twice():
    """Pool of 8, batches of 3: the first 8 draws are the 8 items (a permutation), as an epoch would be; a batch
    never repeats an item; an item that leaves the pool is never drawn again, one that joins waits for a new sweep."""
    sweeps, pool = Sweeps(random.Random(0)), list(range(8))
    draws = [sweeps.take(pool, 3) for _ in range(8)]
    flat = [i for batch in draws for i in batch]
    assert all(len(set(b)) == 3 for b in draws)
    assert sorted(flat[:8]) == pool and sorted(flat[8:16]) == pool  # two whole sweeps in the first 16 draws
    sweeps = Sweeps(random.Random(1))
    first = sweeps.take(pool, 4)
    pool2 = [i for i in pool if i not in first[:1]] + [99]  # one drawn item left, a new one joined
    rest = sweeps.take(pool2, 3)
    assert first[0] not in rest and 99 not in rest and sorted(first + rest) == sorted(set(first + rest))


def test_learner_with_sweeps_trains_on_each_recent_item_once_per_sweep():
    """Four recent requests, batches of 2, no rehearsal: with sweeps, 2 steps cover the 4 once; independent batches
    repeat an item within those 2 steps (on this seed)."""
    _, batches = _batches_after_12_requests(steps_per_update=2, rehearsal=0.0, sweep=True, batch_size=2)
    assert sorted(batches[0] + batches[1]) == sorted(f"r{r}" for r in range(8, 12))
    _, independent = _batches_after_12_requests(steps_per_update=2, rehearsal=0.0, batch_size=2)
    assert len(set(independent[0] + independent[1])) < 4
