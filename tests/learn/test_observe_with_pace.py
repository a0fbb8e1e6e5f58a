"""While the pace spaces updates out, the learner observes 1 request in the pace's factor (observe_with_pace)."""
import torch
from conftest import tiny_qwen2

from osd.engine import StepRecord
from osd.learn.online import LearnConfig, OnlineLearner, observed_at


def step(request_id: str, position: int) -> StepRecord:
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(position))
    return StepRecord(request_id, ("draft", 0), list(range(1, position + 1)), [7], 0, 3, logits, None, [], 0.0, 0.0,
                      0.0)


def observed_requests(learner: OnlineLearner, requests: list[str]) -> set[str]:
    for position in range(4, 7):  # three steps of each request
        for rid in requests:
            learner.observe(step(rid, position))
    return {item.request_id for item in learner.buffer.snapshot()}


def learner(**cfg) -> OnlineLearner:
    return OnlineLearner(tiny_qwen2(seed=1, layers=1), lambda master: None,
                         LearnConfig(mode="all", back_off=8, train_layers=1, **cfg))


REQUESTS = [f"req-{i}" for i in range(200)]


def test_every_request_is_observed_at_factor_one():
    assert observed_requests(learner(), REQUESTS) == set(REQUESTS)


def test_backed_off_learner_observes_one_request_in_the_factor_whole():
    backed_off = learner()
    backed_off.pace.factor = 8
    seen = observed_requests(backed_off, REQUESTS)
    assert seen == {r for r in REQUESTS if observed_at(r, 8)}
    assert 10 <= len(seen) <= 45  # ~1 in 8 of 200 (a hash, not a count: binomial spread)
    assert backed_off.counters["steps_not_observed"] == 3 * (len(REQUESTS) - len(seen))
    for item in backed_off.buffer.snapshot():  # a request observed is observed whole: its 3 steps, one merged item
        assert item.positions == [4, 5, 6]
    assert {it.request_id for it in backed_off.guard_buffer.snapshot()} <= seen  # the guard sees the same sample


def test_the_sample_only_grows_as_the_pace_comes_back():
    for factor in (2, 4, 8):
        at = {r for r in REQUESTS if observed_at(r, factor)}
        assert at >= {r for r in REQUESTS if observed_at(r, 2 * factor)}
        assert 0 < len(at) < len(REQUESTS)


def test_observing_every_request_whatever_the_pace_when_off():
    always = learner(observe_with_pace=False)
    always.pace.factor = 8
    assert observed_requests(always, REQUESTS) == set(REQUESTS) and always.counters["steps_not_observed"] == 0
