"""The replica's sample shipper (cluster/samples.py): payloads per finished request, per size and per age (the flow
the learner reads as "busy"), counted; a send that fails counts its samples as dropped, and serving goes on."""
from __future__ import annotations

import pickle

import torch

from osd.cluster.samples import SampleShipper
from osd.learn.online import LearnConfig
from osd.schedule.records import StepRecord


def record(step: int) -> StepRecord:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(step))
    return StepRecord("r1", ("default", 0), [1, 2, 3] + [4] * step, [5, 6], 1, 7, logits, None, [1.0, 0.0], 0.0,
                      0.0, 0.0)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_samples_ship_per_request_per_size_and_per_age():
    sent, clock = [], Clock()
    shipper = SampleShipper(LearnConfig(mode="all", top_k=8), lambda payload, n: sent.append((pickle.loads(payload), n)),
                            flush_items=3, flush_seconds=0.2, clock=clock)
    shipper.observe(record(0))
    clock.now = 0.1
    shipper.observe(record(1))
    assert sent == []  # young and few: they wait
    clock.now = 0.25
    shipper.observe(record(2))  # the oldest is 0.25 s old: out they go (and it is the 3rd: size too)
    assert len(sent) == 1 and len(sent[0][0]) == 3 and sent[0][1] == 0
    clock.now = 0.3
    shipper.observe(record(3))
    clock.now = 0.45  # 0.15 s old: still waiting
    shipper.observe(record(4))
    assert len(sent) == 1
    shipper.after_request()  # a finished request ships what waits, with the request count
    assert len(sent) == 2 and len(sent[1][0]) == 2 and sent[1][1] == 1
    item, every = sent[1][0][0]
    assert item.positions and every is not None  # the training item and the guard's every-position item
    c = shipper.counters
    assert c["samples_shipped"] == 5 and c["requests_shipped"] == 1 and c["payloads_shipped"] == 2
    assert c["sample_bytes_shipped"] > 0 and c["samples_dropped"] == 0


def test_a_failing_send_drops_the_samples_and_counts_them():
    def send(payload, n):
        raise ConnectionError("learner down")

    shipper = SampleShipper(LearnConfig(mode="all", top_k=8), send)
    shipper.observe(record(0))
    shipper.after_request()
    assert shipper.counters["samples_dropped"] == 1 and shipper.counters["samples_shipped"] == 0
