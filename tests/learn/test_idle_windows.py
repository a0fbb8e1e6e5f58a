"""Background training under load (learn/idle.py): it prefers idle windows, but a server that is never idle still
gets its draft updated, the learner taking about `busy_share` of the time.

Clocks are injected: sleeping advances a virtual clock, so no test sleeps and none asserts on real durations.
"""
import copy
import time

import pytest
from conftest import tiny_qwen2
from helpers import make_engine

from osd.config import SamplingConfig
from osd.errors import InvalidArgument
from osd.learn.idle import IdleWindows
from osd.learn.online import LearnConfig, OnlineLearner

POLL = 0.005


class VirtualClock:
    """Real time plus what the code under test has 'slept' (sleep advances it and returns at once)."""

    def __init__(self, real=time.monotonic):
        self.real, self.slept = real, 0.0

    def __call__(self) -> float:
        return self.real() + self.slept

    def sleep(self, seconds: float) -> None:
        self.slept += seconds


def _saturated(share, chunks, work=1.0):
    """`chunks` chunks of `work` seconds each under permanent load, on a purely virtual clock."""
    now = [0.0]
    clock = VirtualClock(real=lambda: now[0])
    idle = IdleWindows(share, busy=lambda: True, clock=clock, sleep=clock.sleep, poll=POLL)
    idle.begin()
    waits = []
    for _ in range(chunks):
        before = idle.waited
        idle.wait()
        waits.append(idle.waited - before)
        now[0] += work  # the chunk's work
    return idle, waits, clock()


def test_under_permanent_load_each_update_finishes_within_its_work_over_the_share():
    idle, waits, wall = _saturated(share=0.2, chunks=10)
    assert idle.forced == 10  # every chunk ran beside "decoding" in the end
    assert waits[0] == 0.0  # nothing worked yet: no budget
    assert all(abs(w - 4.0) <= POLL + 1e-9 for w in waits[1:])  # (1 - 0.2) / 0.2 = 4 s per second worked, one poll
    assert idle.waited <= 4.0 * 9 + 10 * POLL  # 9 chunks' work (the 10th runs after the last wait)
    assert wall <= 10 / 0.2 + 10 * POLL  # the bound: work / share
    never, waits, wall = _saturated(share=1.0, chunks=5)
    assert waits == [0.0] * 5 and never.forced == 5 and wall == 5.0


def test_an_idle_engine_ends_the_wait_and_a_stop_ends_it_at_once():
    now, busy_polls = [0.0], [3]
    clock = VirtualClock(real=lambda: now[0])

    def busy():
        busy_polls[0] -= 1
        return busy_polls[0] >= 0

    idle = IdleWindows(0.2, busy=busy, clock=clock, sleep=clock.sleep, poll=POLL)
    idle.begin()
    now[0] += 10.0  # worked 10 s: budget 40 s
    idle.wait()
    # returned as soon as the engine was idle: three busy polls, each twice as long as the one before
    assert idle.forced == 0 and idle.waited == pytest.approx(POLL + 2 * POLL + 4 * POLL)
    idle.stop.set()
    busy_polls[0] = 10**6
    idle.wait()
    assert idle.forced == 0 and idle.waited == pytest.approx(7 * POLL)


def test_under_constant_load_the_poll_backs_off_to_max_poll_and_never_sleeps_past_the_budget():
    now = [0.0]
    clock = VirtualClock(real=lambda: now[0])
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        clock.sleep(seconds)

    idle = IdleWindows(0.2, busy=lambda: True, clock=clock, sleep=sleep, poll=POLL, max_poll=0.1)
    idle.begin()
    now[0] += 1.0  # worked 1 s: budget 4 s
    idle.wait()
    assert idle.forced == 1 and idle.waited == pytest.approx(4.0)  # the budget exactly, not one poll more
    assert sleeps[:5] == pytest.approx([POLL, 2 * POLL, 4 * POLL, 8 * POLL, 16 * POLL])
    assert max(sleeps) == pytest.approx(0.1) and len(sleeps) <= 4.0 / 0.1 + 6  # ~45 wakes, not 4 / POLL = 800


def test_busy_share_is_validated_and_a_cli_flag_with_its_help():
    from osd.cli import build_parser, config_from

    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(InvalidArgument, match="busy_share"):
            LearnConfig(busy_share=bad)
    parser = build_parser()
    assert config_from(parser.parse_args(["serve", "--busy-share", "0.5"]), LearnConfig).busy_share == 0.5
    serve = parser._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "--learn-busy-share BUSY_SHARE background schedule" in text and "constant load" in text
    assert "(default: 0.05)" in text.rsplit("--learn-busy-share BUSY_SHARE", 1)[1].split("--learn-", 1)[0]  # serving's


def test_the_background_learner_publishes_on_a_server_that_is_never_idle(target_model, tokenizer):
    draft = tiny_qwen2(seed=1, layers=1)
    engine, registry = make_engine(target_model, copy.deepcopy(draft), tokenizer, k=3)
    publish = lambda master, version=None: registry.publish("draft", copy.deepcopy(master).eval(), None, version)
    clock, share = VirtualClock(), 0.25
    config = LearnConfig(mode="all", every_requests=4, schedule="background", trainable="all", guard=False, lr=1e-2,
                         steps_per_update=3, batch_size=4, busy_share=share)
    learner = OnlineLearner(draft, publish, config, clock=clock, sleep=clock.sleep).attach(engine)
    learner.engine_busy = lambda: True  # permanent load: the engine is never idle
    learner.start()
    try:
        for i in range(4):
            engine.generate([5 + i, 9 + i, 20 + i], SamplingConfig(max_new_tokens=12))
        deadline = time.monotonic() + 120  # a guard against hanging, not a timing assertion
        while learner.counters["updates_published"] < 1 and learner.counters["update_errors"] == 0:
            assert time.monotonic() < deadline, "no update under permanent load"
            time.sleep(0.01)
    finally:
        learner.stop()
    stats = learner.stats()
    assert stats["updates_published"] == 1 and stats["update_errors"] == 0 and registry.get("draft").version == 1
    chunks = 3 * 4  # steps x micro-batches of one item
    assert stats["chunks_under_load"] == chunks  # each ran once its wait budget was spent
    assert stats["idle_wait_seconds"] > 0  # it did wait for idle windows first
    assert stats["idle_wait_seconds"] <= (1 - share) * stats["train_seconds"] + chunks * POLL  # within the bound


def test_a_pause_parks_an_update_in_flight_between_micro_batches_and_the_resume_finishes_it(target_model, tokenizer):
    import threading

    draft = tiny_qwen2(seed=1, layers=1)
    engine, registry = make_engine(target_model, copy.deepcopy(draft), tokenizer, k=3)
    publish = lambda master, version=None: registry.publish("draft", copy.deepcopy(master).eval(), None, version)
    config = LearnConfig(mode="all", every_requests=100, schedule="background", trainable="all", guard=False, lr=1e-2,
                         steps_per_update=3, batch_size=4)
    learner = OnlineLearner(draft, publish, config).attach(engine)
    for i in range(4):
        engine.generate([5 + i, 9 + i, 20 + i], SamplingConfig(max_new_tokens=12))
    first_chunk, go, chunks = threading.Event(), threading.Event(), []

    def wait_for_idle():  # the learner's wait before each chunk of work: hold the first until the test says go
        chunks.append(learner.counters["optimizer_steps"])
        first_chunk.set()
        assert go.wait(timeout=60)

    learner.idle.wait = wait_for_idle
    updating = threading.Thread(target=learner.update)
    updating.start()
    assert first_chunk.wait(timeout=60)
    paused = []
    pausing = threading.Thread(target=lambda: paused.append(learner.pause(timeout=60)))
    pausing.start()
    go.set()  # the first chunk runs; the learner parks before the next one
    pausing.join(timeout=60)
    assert paused == [True] and learner.stats()["parked"] == 1 and learner.training
    parked_at = (len(chunks), learner.counters["optimizer_steps"])
    time.sleep(0.2)  # parked means no work: nothing moves
    assert (len(chunks), learner.counters["optimizer_steps"]) == parked_at and updating.is_alive()
    assert parked_at[1] < 3 and learner.version == 0  # mid-update: neither finished nor published
    learner.unpause()
    updating.join(timeout=60)
    assert not updating.is_alive() and learner.stats()["parked"] == 0
    assert learner.counters["optimizer_steps"] == 3 and learner.version == 1  # the resumed update finished


def test_no_learner_chunk_runs_beside_a_serving_step(target_model, tokenizer):
    """Background learning with no idle waits at all (busy_share 1) while requests decode: the learner's forwards
    (training and the guard's evaluations) and the scheduler's steps never overlap (schedule/turns.py); on 2 cores two
    OpenMP teams at once cost serving far more than the learner's share."""
    import threading

    draft = tiny_qwen2(seed=1, layers=1)
    engine, registry = make_engine(target_model, copy.deepcopy(draft), tokenizer, k=3)
    publish = lambda master, version=None: registry.publish("draft", copy.deepcopy(master).eval(), None, version)
    config = LearnConfig(mode="all", every_requests=2, schedule="background", trainable="all", lr=1e-2,
                         steps_per_update=2, batch_size=4, busy_share=1.0, guard_z=0.0)
    learner = OnlineLearner(draft, publish, config).attach(engine)
    active, overlaps, forwards = {"step": 0, "chunk": 0}, [], [0]
    lock = threading.Lock()

    def enter(kind, other):
        with lock:
            active[kind] += 1
            if active[other]:
                overlaps.append(kind)

    def leave(kind):
        with lock:
            active[kind] -= 1

    step = engine.scheduler._step

    def timed_step():
        enter("step", "chunk")
        try:
            return step()
        finally:
            leave("step")

    learning = lambda: threading.current_thread().name == "osd-learner"  # (published copies carry the hooks too)

    def before_forward(module, args):
        if learning():
            enter("chunk", "step")
            forwards[0] += 1

    def after_forward(module, args, output):
        if learning():
            leave("chunk")

    engine.scheduler._step = timed_step
    draft.lm_head.register_forward_pre_hook(before_forward)  # every learner forward ends in the head
    draft.lm_head.register_forward_hook(after_forward)
    learner.start()
    try:
        for i in range(24):
            engine.generate([5 + i, 9 + i, 20 + i], SamplingConfig(max_new_tokens=16))
        deadline = time.monotonic() + 120  # a guard against hanging, not a timing assertion
        while learner.counters["updates_published"] + learner.counters["updates_rejected"] < 2:
            assert time.monotonic() < deadline and learner.counters["update_errors"] == 0
            engine.generate([7, 8, 9], SamplingConfig(max_new_tokens=16))
    finally:
        learner.stop()
    assert forwards[0] > 0 and learner.counters["optimizer_steps"] > 0  # the learner did work while requests decoded
    assert overlaps == []


def test_the_background_learners_openmp_team_ends_with_each_update(target_model, tokenizer):
    """The learner thread's torch ops start an OpenMP team of its own; left alive beside serving, libgomp stops letting
    idle team threads spin and every target pass slowed ~20% (README, "What learning costs"). After each update the
    thread ends its team (`end_thread_team` in `_run`'s finally): counted as the process's threads, the team that the
    update started is gone once it returns, though the thread lives on."""
    import os
    import threading

    import torch
    from conftest import skip_or_fail

    from osd.schedule.turns import _libgomp

    if _libgomp() is None or torch.get_num_threads() < 2:
        skip_or_fail(f"needs torch on libgomp with 2+ threads (libgomp {_libgomp()}, {torch.get_num_threads()} threads)")
    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    draft = tiny_qwen2(seed=1, layers=1)
    engine, registry = make_engine(target_model, copy.deepcopy(draft), tokenizer, k=3)
    publish = lambda master, version=None: registry.publish("draft", copy.deepcopy(master).eval(), None, version)
    config = LearnConfig(mode="all", every_requests=100, schedule="background", trainable="all", guard=False, lr=1e-2)
    learner = OnlineLearner(draft, publish, config).attach(engine)
    x = torch.randn(1024, 1024)
    seen, done = {}, threading.Event()

    def update():  # what an update does to the thread's OpenMP state: a parallel region of its own team
        seen["before"] = threads()
        (x * 2).sum()
        seen["during"] = threads() - seen["before"]
        done.set()

    learner.maybe_update = update
    learner.start()
    try:
        learner._wake.set()
        assert done.wait(timeout=60)
        deadline = time.monotonic() + 10
        while threads() > seen["before"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen["during"] == torch.get_num_threads() - 1 and threads() == seen["before"]
        assert learner._thread.is_alive()
    finally:
        learner.stop()
