"""The front's request driver (cluster/pool.py) against stand-in replicas (no Ray processes): the least-loaded
choice, a retry when a replica dies before answering, a greedy or seeded stream resumed on another replica without
repeating or losing text, a sampled unseeded one failed with a clear error, and a resumed answer that differs refused
instead of spliced."""
from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayActorError

from osd.cluster.pool import ReplicaPool
from osd.config import SamplingConfig
from osd.serve.errors import ReplicaFailed

WORDS = ["Hel", "lo ", "wor", "ld", "!"]


class FakeReplica:
    """Streams `words` (then "done"), or dies with RayActorError after `die_after` of them."""

    def __init__(self, words=WORDS, die_after: int | None = None):
        self.words, self.die_after, self.calls = words, die_after, 0
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, prompt_ids, sampling, draft):
        self.calls += 1
        return self._stream()

    async def _stream(self):
        for n, word in enumerate(self.words):
            if self.die_after is not None and n == self.die_after:
                raise RayActorError()
            yield _done(("text", word))
        yield _done(("done", "".join(self.words)))


def _done(value):
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def run(pool, sampling, stream=True):
    async def go():
        pool._mark_down = lambda i: pool.down.add(i)  # no revival task in these tests
        pool.inflight = [0, 1]  # replica 0 (the one that dies) is the least loaded: it is asked first
        job = pool.submit([1, 2], sampling, stream=stream)
        texts = []
        while True:
            kind, payload = await job.next()
            if kind == "text":
                texts.append(payload)
            else:
                return kind, payload, "".join(texts)

    return asyncio.run(go())


GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8)


def test_requests_go_to_the_least_loaded_replica():
    pool = ReplicaPool([FakeReplica(), FakeReplica()])
    pool.inflight = [3, 0]
    assert pool._pick([]) == 1
    assert pool._pick([1]) == 0
    pool.down.add(1)
    assert pool._pick([]) == 0  # a replica marked down is passed over while another is up


def test_a_replica_that_dies_before_answering_is_retried_elsewhere():
    dead, alive = FakeReplica(die_after=0), FakeReplica()
    pool = ReplicaPool([dead, alive])
    kind, payload, streamed = run(pool, SamplingConfig(temperature=0.8, max_new_tokens=8))
    assert (kind, payload, streamed) == ("done", "Hello world!", "Hello world!")
    assert pool.counters["retries"] == 1 and pool.down == {0}


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.8, seed=7, max_new_tokens=8)])
def test_a_reproducible_stream_resumes_on_another_replica_without_repeating_text(sampling):
    pool = ReplicaPool([FakeReplica(die_after=3), FakeReplica()])
    kind, payload, streamed = run(pool, sampling)
    assert kind == "done" and streamed == "Hello world!"  # every character once, in order
    assert pool.counters["resumed"] == 1 and pool.counters["failed_mid_stream"] == 0


def test_an_unseeded_sampled_stream_that_loses_its_replica_fails_clearly():
    pool = ReplicaPool([FakeReplica(die_after=2), FakeReplica()])
    kind, payload, streamed = run(pool, SamplingConfig(temperature=0.8, max_new_tokens=8))
    assert kind == "error" and isinstance(payload, ReplicaFailed) and "incomplete" in str(payload)
    assert streamed == "Hello " and pool.counters["failed_mid_stream"] == 1


def test_a_resumed_answer_that_differs_is_refused_not_spliced():
    other = FakeReplica(words=["Hel", "p m", "e"])
    pool = ReplicaPool([FakeReplica(die_after=2), other])
    kind, payload, streamed = run(pool, GREEDY)
    assert kind == "error" and "differs" in str(payload)
    assert streamed == "Hello "  # nothing of the other answer reached the client
