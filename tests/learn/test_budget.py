"""The learner's time under load (learn/budget.py): idle windows are free; while requests decode it earns
busy_share / (1 - busy_share) seconds per second of serving steps, spent one chunk at a time between two steps. A
server that is never idle still gets its draft updated, and the learner never takes more than its share.

Clocks are injected: a fake scheduler advances a virtual clock, so no test sleeps and none asserts on real durations.
"""
import copy
import threading
import time

import pytest
from conftest import tiny_qwen2
from helpers import make_engine

from osd.config import SamplingConfig
from osd.errors import InvalidArgument
from osd.learn.budget import LearnBudget
from osd.learn.online import LearnConfig, OnlineLearner

class FakeTurns:
    """Stands for the engine's Turns: only its listeners matter here (the fake scheduler runs on the same thread)."""

    def __init__(self):
        self.listeners = []

    def take(self, owner, stop=None):
        return True

    def give_back(self, owner):
        pass


class BusyScheduler:
    """A server that is never idle: while the learner sleeps, steps of `step` seconds run back to back on a virtual
    clock, each reported to the budget as Turns reports a real step; `events` records steps and learner chunks."""

    def __init__(self, share, step=0.1, **budget):
        self.now, self.step, self.events = 0.0, step, []
        self.budget = LearnBudget(share, busy=lambda: True, clock=lambda: self.now, sleep=self.run, **budget)
        self.budget.turns = FakeTurns()

    def run(self, seconds):
        end = self.now + seconds
        while self.now < end:  # whole steps: a step that starts runs to its end
            self.now += self.step
            self.events.append("step")
            self.budget.served(self.step)

    def chunk(self, seconds):
        self.budget.wait()
        self.events.append("chunk")
        self.now += seconds
        self.budget.release()


@pytest.mark.parametrize("share,step,chunk", [(0.1, 0.1, 0.15), (0.25, 0.05, 0.1), (0.05, 0.3, 0.2), (1.0, 0.1, 0.1)])
def test_under_permanent_load_the_learner_takes_its_share_and_none_beyond(share, step, chunk):
    sched = BusyScheduler(share, step)
    for _ in range(200):
        sched.chunk(chunk)
    b = sched.budget
    assert b.busy_chunks == 200 and b.idle_chunks == 0 and b.busy_seconds == pytest.approx(200 * chunk)
    if share < 1.0:  # within the share, one chunk of slack; and not starved: within two chunks of it
        assert b.busy_seconds <= b.rate() * b.serving_seconds + chunk + 1e-9
        assert b.busy_seconds >= b.rate() * b.serving_seconds - 2 * max(chunk, step * b.rate()) - 1e-9
        assert b.stats()["busy_share_measured"] == pytest.approx(share, abs=0.03)
    # a step waits for one chunk at most: never two chunks without a step between them
    assert all(not (a == c == "chunk") for a, c in zip(sched.events, sched.events[1:]))


def test_the_grant_follows_the_measured_cost_of_serving():
    """Steps four times as long earn four times the learner time per step: the same learner work costs the same
    serving seconds, and its share of the busy time stays the same."""
    light, heavy = BusyScheduler(0.2, step=0.05), BusyScheduler(0.2, step=0.2)
    for sched in (light, heavy):
        for _ in range(100):
            sched.chunk(0.1)
    assert light.budget.serving_seconds == pytest.approx(heavy.budget.serving_seconds, rel=0.05)
    assert light.events.count("step") == pytest.approx(4 * heavy.events.count("step"), rel=0.05)


def test_idle_time_is_free_and_credit_is_capped():
    now = [0.0]
    busy = [False]
    budget = LearnBudget(0.1, busy=lambda: busy[0], clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s),
                         burst=0.5)
    budget.turns = FakeTurns()
    for _ in range(10):  # idle: each chunk starts at once, nothing charged
        budget.wait()
        now[0] += 1.0
        budget.release()
    assert budget.idle_chunks == 10 and budget.idle_seconds == pytest.approx(10.0) and budget.waited_total == 0.0
    assert budget.busy_seconds == 0.0
    busy[0] = True  # a request arrived during the last idle chunk: its step runs before the next chunk
    budget.credit = budget.expected  # (credit enough for a chunk)
    assert not budget._may_start_busy()
    budget.served(0.1)
    assert budget._may_start_busy()
    for _ in range(1000):  # a long busy stretch with the learner away: the credit stops at the cap
        budget.served(0.1)
    assert budget.credit <= max(0.5, 2 * budget.expected)


def test_a_stop_ends_the_wait_at_once():
    now = [0.0]
    budget = LearnBudget(0.1, busy=lambda: True, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    budget.turns = FakeTurns()  # steps report nothing: no credit ever
    budget.stop.set()
    budget.wait()
    assert now[0] == 0.0


def test_without_step_reports_busy_wall_time_earns_the_credit():
    """A learner with no Turns (a cluster's, serving elsewhere) earns its share from the wall time while busy."""
    now = [0.0]
    budget = LearnBudget(0.2, busy=lambda: True, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    for _ in range(50):
        budget.wait()
        now[0] += 0.1
        budget.release()
    assert budget.busy_chunks == 50
    assert budget.busy_seconds <= budget.rate() * budget.serving_seconds + 0.1 + 1e-9


def test_busy_share_is_validated_and_a_cli_flag_with_its_help():
    from osd.cli import build_parser, config_from

    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(InvalidArgument, match="busy_share"):
            LearnConfig(busy_share=bad)
    parser = build_parser()
    assert config_from(parser.parse_args(["serve", "--busy-share", "0.5"]), LearnConfig).busy_share == 0.5
    serve = parser._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "--learn-busy-share BUSY_SHARE background schedule" in text and "serving steps" in text
    assert "(default: 0.03)" in text.rsplit("--learn-busy-share BUSY_SHARE", 1)[1].split("--learn-", 1)[0]  # serving's


def test_the_background_learner_publishes_on_a_server_that_is_never_idle(target_model, tokenizer):
    """Requests decode all the time (the engine never reads idle): the learner's chunks run between the real steps,
    on the credit those steps earn, and an update publishes; its time under load stays within its share."""
    draft = tiny_qwen2(seed=1, layers=1)
    engine, registry = make_engine(target_model, copy.deepcopy(draft), tokenizer, k=3)
    publish = lambda master, version=None: registry.publish("draft", copy.deepcopy(master).eval(), None, version)
    share = 0.25
    config = LearnConfig(mode="all", every_requests=4, schedule="background", trainable="all", guard=False, lr=1e-2,
                         steps_per_update=3, batch_size=4, busy_share=share, chunk_positions=1)  # an item a chunk
    learner = OnlineLearner(draft, publish, config).attach(engine)
    learner.engine_busy = lambda: True  # permanent load: the engine is never idle
    learner.start()
    try:
        for i in range(4):
            engine.generate([5 + i, 9 + i, 20 + i], SamplingConfig(max_new_tokens=12))
        deadline = time.monotonic() + 120  # a guard against hanging, not a timing assertion
        while learner.counters["updates_published"] < 1 and learner.counters["update_errors"] == 0:
            assert time.monotonic() < deadline, "no update under permanent load"
            engine.generate([7, 8, 9], SamplingConfig(max_new_tokens=12))  # the load goes on: steps earn the credit
    finally:
        learner.stop()
    stats = learner.stats()
    assert stats["updates_published"] == 1 and stats["update_errors"] == 0 and registry.get("draft").version == 1
    assert stats["chunks_under_load"] == 3 * 4 and stats["chunks_idle"] == 0  # steps x chunks of one item
    rate = share / (1 - share)
    assert stats["learner_busy_seconds"] <= rate * stats["serving_seconds"] + stats["chunk_seconds_max"] + 1e-6


def test_a_pause_parks_an_update_in_flight_between_micro_batches_and_the_resume_finishes_it(target_model, tokenizer):

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


def test_no_chunk_starts_and_no_credit_is_earned_while_a_request_waits_for_its_first_token():
    """Pressure (a request queued or prefilling: Engine.pressure) holds the learner back: the steps taken under it
    earn nothing, so the learner does not take them back in a burst afterwards; once it ends, the share resumes."""
    pressed = [True]
    sched = BusyScheduler(0.2, step=0.1, pressure=lambda: pressed[0])
    # on this thread: the learner polls (sleep runs steps) and must not start while pressed; stop it after 50 steps
    stop_after = 50

    def run_then_release(seconds):
        BusyScheduler.run(sched, seconds)
        if sched.events.count("step") >= stop_after:
            pressed[0] = False

    sched.budget.sleep = run_then_release
    sched.chunk(0.1)
    b = sched.budget
    assert sched.events.index("chunk") >= stop_after  # nothing ran under pressure
    assert b.pressed_seconds == pytest.approx(0.1 * stop_after) and b.busy_chunks == 1
    assert b.stats()["serving_seconds_under_pressure"] == b.pressed_seconds
    # the steps under pressure earned nothing: the first chunk waited for credit earned after it ended
    assert b.busy_seconds <= b.rate() * (b.serving_seconds - b.pressed_seconds) + 0.1 + 1e-9


def test_the_engine_is_under_pressure_while_a_request_is_queued_or_has_no_token_yet(target_model, tokenizer):
    engine, _ = make_engine(target_model, tiny_qwen2(seed=1, layers=1), tokenizer, k=2)
    assert not engine.pressure()
    engine.queued = lambda: 2
    assert engine.pressure()
    engine.queued = lambda: 0
    seq = engine.scheduler.add([5, 6, 7, 8], SamplingConfig(max_new_tokens=4))
    assert engine.pressure()  # admitted, not one token yet
    while not seq.stopper.token_ids:
        engine.scheduler.step()
    assert not engine.pressure()
