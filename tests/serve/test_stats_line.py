"""The periodic stats line (serve/stats_line.py): its figures are deltas of the server's counters over the interval,
an idle server logs nothing, and a running server logs it."""
from __future__ import annotations

import logging
import re
import time

import httpx

from osd.serve.stats_line import StatsLine, active, format_stats


def snap(emitted=0, prefill=0, proposed=0, accepted=0, seq_steps=0, running=0, queued=0, drafts=None, learner=None,
         extra=None) -> dict:
    return {"emitted": emitted, "prefill_rows": prefill, "proposed": proposed, "accepted": accepted,
            "sequence_steps": seq_steps, "running": running, "queued": queued, "drafts": drafts or {"draft": 7},
            "learner": learner, "extra": extra or {}}


def test_format_stats_divides_the_deltas_over_the_interval():
    prev = snap(emitted=100, prefill=50, proposed=200, accepted=100, seq_steps=50)
    now = snap(emitted=512, prefill=1250, proposed=600, accepted=348, seq_steps=150, running=3, queued=1,
               learner={"training": 1, "optimizer_steps": 120, "updates_published": 7})
    assert format_stats(prev, now, 10.0) == (
        "running 3 | queued 1 | gen 41.2 tok/s | prompt 120 tok/s | acceptance 0.62 | tokens/step 4.12 | k 4.0 | "
        "draft v7 | learner: training (steps 120, published 7)")


def test_format_stats_without_steps_learner_or_with_several_drafts_and_extras():
    line = format_stats(snap(), snap(drafts={"b": 2, "a": 5}, extra={"learned vs v0": "+0.05"}), 5.0)
    assert line == ("running 0 | queued 0 | gen 0.0 tok/s | prompt 0 tok/s | acceptance - | tokens/step - | k - | "
                    "drafts a v5, b v2 | learner: off | learned vs v0 +0.05")
    paused = {"paused": 1, "training": 1, "optimizer_steps": 3, "updates_published": 1, "updates_rejected": 2}
    line = format_stats(snap(), snap(learner=paused), 1.0)
    assert line.endswith("learner: paused (steps 3, published 1, rejected 2)")
    backed_off = {**paused, "updates_rejected": 0, "update_every_requests": 32}
    assert format_stats(snap(), snap(learner=backed_off), 1.0).endswith(
        "learner: paused (steps 3, published 1, every 32 requests)")
    assert "| draft none |" in format_stats(snap(), {**snap(), "drafts": {}}, 1.0)


def test_an_idle_interval_is_not_active():
    idle = {"training": 0, "optimizer_steps": 4, "updates_published": 1}
    assert not active(snap(learner=idle), snap(learner=idle))
    assert active(snap(), snap(running=1)) and active(snap(), snap(queued=1)) and active(snap(), snap(emitted=1))
    assert active(snap(learner=idle), snap(learner={**idle, "optimizer_steps": 5}))
    assert active(snap(), snap(drafts={"draft": 8}))


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_stats_line_ticks_on_an_injected_clock(caplog):
    busy = dict(emitted=30, proposed=40, accepted=20, seq_steps=10)
    snaps = iter([snap(), snap(**busy, running=1), snap(**busy)])
    clock = Clock()
    line = StatsLine(lambda: next(snaps), interval=3.0, extras=[lambda: {"x": 1}], clock=clock)
    with caplog.at_level(logging.INFO, logger="osd.stats"):
        assert line.tick() is None  # the baseline
        clock.t += 3.0
        assert line.tick().startswith("running 1 | queued 0 | gen 10.0 tok/s | prompt 0 tok/s | acceptance 0.50 | "
                                      "tokens/step 3.00 | k 4.0 | draft v7 | learner: off | x 1")
        clock.t += 3.0
        assert line.tick() is None  # nothing happened: an idle server says nothing
    assert [r.getMessage()[:9] for r in caplog.records if r.name == "osd.stats"] == ["running 1"]


def test_a_failing_extra_does_not_stop_the_line(caplog):
    line = StatsLine(lambda: snap(running=1), interval=1.0, extras=[lambda: 1 / 0], clock=Clock())
    line.tick()
    assert line.tick().startswith("running 1")


def test_a_running_server_logs_the_line(caplog):
    from serve_testing import MODEL, tiny_server

    with caplog.at_level(logging.INFO, logger="osd.stats"), tiny_server(k=3, stats_interval=0.2) as served:
        with httpx.Client(base_url=served.url, timeout=60) as http:
            body = {"model": MODEL, "prompt": "abc", "max_tokens": 24, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
        deadline = time.monotonic() + 10
        while not any(r.name == "osd.stats" for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name == "osd.stats"]
    assert lines, "no stats line"
    assert "tok/s" in lines[0] and "acceptance" in lines[0] and "draft v" in lines[0] and "learner: off" in lines[0]


def test_no_line_with_stats_interval_zero(caplog):
    from serve_testing import MODEL, tiny_server

    with caplog.at_level(logging.INFO, logger="osd.stats"), tiny_server(k=3, stats_interval=0) as served:
        with httpx.Client(base_url=served.url, timeout=60) as http:
            http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0})
    assert not [r for r in caplog.records if r.name == "osd.stats"]


def test_with_a_learner_the_line_says_what_learning_has_done_per_draft_version(caplog):
    """The learning figure: the serving draft's version, acceptance and tokens per step (issue 62), from the same
    per-version counters /metrics reads."""
    from serve_testing import MODEL, FakeLearner, tiny_server

    with caplog.at_level(logging.INFO, logger="osd.stats"), \
            tiny_server(k=3, stats_interval=0.2, learner=FakeLearner()) as served:
        with httpx.Client(base_url=served.url, timeout=60) as http:
            body = {"model": MODEL, "prompt": "abc", "max_tokens": 24, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
        deadline = time.monotonic() + 10
        learning = lambda: [r.getMessage() for r in caplog.records if r.name == "osd.stats" and "| learning" in r.getMessage()]
        while not learning() and time.monotonic() < deadline:
            time.sleep(0.05)
        counters = served.engine.metrics.counters()
    assert learning(), "no stats line with the learning figure"
    (draft, version), = counters  # one draft, one version served
    assert re.search(rf"\| learning {draft} v{version} acc \d\.\d\d tok/step \d\.\d\d", learning()[-1]), learning()[-1]
