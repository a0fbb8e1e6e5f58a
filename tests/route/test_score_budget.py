"""The router's scoring stays within its time budget (RouteConfig.score_time_share), also when jobs queue up while
the engine is busy (background schedule)."""
import threading
import time
from types import SimpleNamespace

import pytest

import osd.route.feedback as feedback
from osd.route.config import RouteConfig
from osd.route.feedback import RouteFeedback


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Router:
    def featurize(self, prompt_ids):
        return None

    def names(self):
        return ["a", "b"]

    def learn(self, features, rewards):
        self.last = rewards


class Drafts:
    lock = threading.RLock()

    def names(self):
        return ["a", "b"]


def request(seconds=1.0):
    return SimpleNamespace(draft=("a", 0), prompt_ids=[1, 2], token_ids=[3, 4], seconds=seconds)


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()

    def score_drafts(drafts, names, prompt_ids, output_ids, max_tokens):  # one scoring job: 1 s of the clock
        clock.t += 1.0
        return {n: [True, n == "a"] for n in names}

    monkeypatch.setattr(feedback, "score_drafts", score_drafts)
    return clock


@pytest.mark.parametrize("schedule", ["background", "sync"])
def test_scoring_seconds_stay_within_the_time_share_of_serving(clock, schedule):
    """50 requests of 1 s, 10% for scoring: 5 s. In the background schedule all 50 jobs are queued before any is
    scored (a busy engine); taking them must still stop at the budget. Without the check at take time, 50 s."""
    fb = RouteFeedback(Router(), Drafts(), RouteConfig(score_share=1.0, score_time_share=0.1, score_schedule=schedule),
                       clock=clock)
    for _ in range(50):
        fb.after_request(request())
    fb.drain()
    c = fb.counters
    assert c["score_seconds"] <= 0.1 * c["serving_seconds"] == pytest.approx(5.0)
    assert c["scored"] == 5 and c["over_time_budget"] == 45
    for _ in range(20):  # more serving makes room again
        fb.after_request(request())
    fb.drain()
    assert c["scored"] == 7 and c["score_seconds"] <= 0.1 * c["serving_seconds"]


def test_a_zero_time_share_scores_nothing(clock):
    fb = RouteFeedback(Router(), Drafts(), RouteConfig(score_share=1.0, score_time_share=0.0), clock=clock)
    for _ in range(10):
        fb.after_request(request())
    assert fb.counters["scored"] == 0 and fb.counters["over_time_budget"] == 10


def test_waiting_for_a_draft_update_is_not_counted_as_scoring(clock):
    """Scoring needs the drafts' lock, which a learner's update holds for seconds: that wait is not scoring's cost
    (it would eat the time budget and stop the router's feedback for nothing)."""
    drafts = Drafts()
    fb = RouteFeedback(Router(), drafts, RouteConfig(score_share=1.0, score_time_share=0.5), clock=clock)
    held, release = threading.Event(), threading.Event()

    def update():
        with drafts.lock:
            held.set()
            release.wait(10)
            clock.t += 30.0  # the update's 30 s pass while scoring waits

    holder = threading.Thread(target=update)
    holder.start()
    held.wait()
    scorer = threading.Thread(target=fb.after_request, args=(request(10.0),))
    scorer.start()
    time.sleep(0.3)  # the scorer reaches the lock and waits
    release.set()
    holder.join()
    scorer.join()
    assert fb.counters["scored"] == 1 and fb.counters["score_seconds"] == pytest.approx(1.0)


def test_the_background_scorer_backs_off_while_the_engine_stays_busy(clock):
    """Each poll of a busy engine wakes the scorer's thread, which then takes the GIL from the serving thread: under
    constant load it polls a few times a second (backing off to 0.1 s), not every 5 ms (~100 polls in 0.5 s)."""
    polls, idle = [], threading.Event()

    def busy():
        polls.append(time.monotonic())
        return not idle.is_set()

    fb = RouteFeedback(Router(), Drafts(), RouteConfig(score_share=1.0, score_time_share=1.0,
                                                       score_schedule="background"), engine_busy=busy, clock=clock)
    fb.start()
    try:
        fb.after_request(request())
        time.sleep(0.5)
        busy_polls = len(polls)
        idle.set()
        deadline = time.monotonic() + 10
        while fb.counters["scored"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 2 <= busy_polls <= 15 and fb.counters["scored"] == 1  # it still scores once the engine is idle
    finally:
        fb.stop()
