"""The cores go to one party at a time (schedule/turns.py): a serving step, or a background chunk, never both.

Ordering is checked with events, never with durations."""
import threading
import time

from osd.schedule.turns import Turns

TIMEOUT = 30  # a guard against hanging, not a timing assertion


def _thread(target):
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def test_a_background_chunk_waits_for_the_step_in_flight_and_the_next_step_waits_for_the_chunk():
    turns, owner, log = Turns(), object(), []
    in_step, end_step = threading.Event(), threading.Event()

    def step():
        with turns.serving():
            log.append("step begins")
            in_step.set()
            assert end_step.wait(TIMEOUT)
            log.append("step ends")

    stepping = _thread(step)
    assert in_step.wait(TIMEOUT)
    took = threading.Event()
    taking = _thread(lambda: (turns.take(owner), log.append("chunk begins"), took.set()))
    assert not took.wait(0.2)  # the step is still in flight: no chunk beside it
    end_step.set()
    assert took.wait(TIMEOUT) and turns.background
    stepping.join(TIMEOUT), taking.join(TIMEOUT)
    in_step.clear(), end_step.clear()
    next_step = _thread(step)
    assert not in_step.wait(0.2)  # the chunk holds the cores: the next step waits
    turns.give_back(owner)
    assert in_step.wait(TIMEOUT)
    end_step.set()
    next_step.join(TIMEOUT)
    assert log == ["step begins", "step ends", "chunk begins", "step begins", "step ends"]


def test_an_asking_chunk_goes_ahead_of_the_step_loop():
    """The step loop re-enters at once after each step; a chunk that asks still gets the next boundary."""
    turns, owner, stop = Turns(), object(), threading.Event()
    steps, chunk_at = [0], []

    def step_loop():
        while not stop.is_set():
            with turns.serving():
                steps[0] += 1

    looping = _thread(step_loop)
    while steps[0] < 10:
        pass
    assert turns.take(owner)
    chunk_at.append(steps[0])
    time.sleep(0.1)  # (lets the step loop's thread run, if it could)
    assert steps[0] == chunk_at[0]  # no step ran while the chunk held the cores
    turns.give_back(owner)
    while steps[0] <= chunk_at[0]:
        pass  # and they resume once it gives them back
    stop.set()
    looping.join(TIMEOUT)


def test_give_back_is_the_owners_alone_and_take_stops_on_request():
    turns, a, b = Turns(), object(), object()
    assert turns.take(a) and turns.take(a)  # taking again what one holds is a no-op
    turns.give_back(b)
    assert turns.background  # b held nothing: a still holds the cores
    stop, result = threading.Event(), []
    waiting = _thread(lambda: result.append(turns.take(b, stop)))
    stop.set()
    waiting.join(TIMEOUT)
    assert result == [False] and turns.background  # b gave up; a still holds them
    turns.give_back(a)
    assert not turns.background and turns.take(b)


def test_giving_the_cores_back_ends_the_background_threads_openmp_team():
    """libgomp stops idle team threads from spinning once the process's team threads outnumber the cores, which made
    every target pass of a learning server ~20% slower: the learner's team must not outlive its chunk. Counted as the
    process's threads: the chunk's two-thread torch op starts a worker, giving the cores back ends it."""
    import os

    import torch
    from conftest import skip_or_fail

    from osd.schedule.turns import _libgomp

    if _libgomp() is None or torch.get_num_threads() < 2:
        skip_or_fail(f"needs torch on libgomp with 2+ threads (libgomp {_libgomp()}, {torch.get_num_threads()} threads)")
    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    x = torch.randn(1024, 1024)
    (x * 2).sum()  # this thread's own team exists before counting
    turns, owner, seen = Turns(), object(), {}

    def chunk():
        turns.take(owner)
        before = threads()
        (x * 2).sum()  # above torch's grain: a parallel region of this thread's own team
        seen["with_team"] = threads() - before
        turns.give_back(owner)
        seen["after"] = threads() - before
        (x * 2).sum()  # torch without the cores (an update's restore point before its first chunk): a team again
        seen["without_cores"] = threads() - before
        turns.give_back(owner)  # holding nothing: the turn is not touched, the team still ends before the wait
        seen["after_wait"] = threads() - before

    t = _thread(chunk)
    t.join(TIMEOUT)
    n = torch.get_num_threads() - 1
    assert seen == {"with_team": n, "after": 0, "without_cores": n, "after_wait": 0}
