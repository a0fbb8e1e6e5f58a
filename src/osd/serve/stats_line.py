"""A periodic line of what the server is doing, logged at info every --stats-interval seconds (as vLLM and
llama-server print theirs):

  running 3 | queued 0 | gen 41.2 tok/s | prompt 120 tok/s | acceptance 0.62 | tokens/step 2.4 | k 4.0 | draft v7 |
  learner: training (steps 120, published 7)

(one line). Definitions, over the interval since the previous line, from the counters /metrics exposes (the
scheduler's StepStats, serve/prom.py; the learner's stats), as deltas:
  running, queued        sequences in the scheduler, and requests waiting for a place (now)
  gen tok/s              tokens emitted / seconds               (emitted = accepted + recovered + bonus)
  prompt tok/s           prompt tokens fed to the target / seconds (prefill rows; a reused prefix is not fed)
  acceptance             draft tokens accepted / proposed
  tokens/step            tokens emitted / sequence steps         (a sequence's step: one proposal, one verification)
  k                      draft tokens proposed / sequence steps  (the adaptive k actually used)
  draft                  the serving draft's published version (per draft with --drafts)
  learner                training | idle | paused | off; optimizer steps and updates published so far, and
                         the requests between updates now (more while updates stop paying)
A figure with nothing to divide by (no step in the interval) shows "-". An idle server (nothing ran, queued,
trained or published in the interval) logs nothing.
`extras`: callables returning {label: value} appended as "label value" (a place for more figures, e.g. the learned
draft's acceptance against the first version's).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("osd.stats")

COUNTERS = ("emitted", "prefill_rows", "proposed", "accepted", "sequence_steps")  # StepStats fields, monotonic
LEARNER_TOTALS = ("optimizer_steps", "updates_published", "updates_rejected")


def read_engine(engine, worker, learner=None, drafts: Callable[[], dict] = dict) -> dict:
    """One snapshot: the scheduler's counters, what runs and waits, the drafts' versions, the learner's stats."""
    stats = engine.scheduler.stats
    snap = {name: getattr(stats, name) for name in COUNTERS}
    snap.update(running=len(engine.scheduler.running), queued=worker.depth, drafts=dict(drafts()))
    if learner is not None:
        try:
            snap["learner"] = learner.stats()
        except Exception:  # a learner fault must not stop the line
            log.exception("learner.stats() failed")
            snap["learner"] = {}
    return snap


def _ratio(a: float, b: float, fmt: str) -> str:
    return format(a / b, fmt) if b > 0 else "-"


def _drafts(versions: dict) -> str:
    if not versions:
        return "draft none"
    if len(versions) == 1:
        return f"draft v{next(iter(versions.values()))}"
    return "drafts " + ", ".join(f"{name} v{v}" for name, v in sorted(versions.items()))


def _learner(stats: dict | None) -> str:
    if stats is None:
        return "learner: off"
    state = "paused" if stats.get("paused") else "training" if stats.get("training") else "idle"
    done = f"steps {stats.get('optimizer_steps', 0)}, published {stats.get('updates_published', 0)}"
    if stats.get("updates_rejected"):
        done += f", rejected {stats['updates_rejected']}"
    if stats.get("update_every_requests"):  # the pace: longer while updates stop paying (learn/triggers.py Pace)
        done += f", every {stats['update_every_requests']} requests"
    return f"learner: {state} ({done})"


def format_stats(prev: dict, now: dict, dt: float) -> str:
    """The line for the interval between two snapshots (read_engine) dt seconds apart."""
    d = {name: now[name] - prev[name] for name in COUNTERS}
    parts = [f"running {now['running']}", f"queued {now['queued']}",
             f"gen {_ratio(d['emitted'], dt, '.1f')} tok/s", f"prompt {_ratio(d['prefill_rows'], dt, '.0f')} tok/s",
             f"acceptance {_ratio(d['accepted'], d['proposed'], '.2f')}",
             f"tokens/step {_ratio(d['emitted'], d['sequence_steps'], '.2f')}",
             f"k {_ratio(d['proposed'], d['sequence_steps'], '.1f')}",
             _drafts(now.get("drafts") or {}), _learner(now.get("learner"))]
    parts += [f"{label} {value}" for label, value in (now.get("extra") or {}).items()]
    return " | ".join(parts)


def active(prev: dict, now: dict) -> bool:
    """Whether anything happened between two snapshots (or is happening now)."""
    learner_moved = any((now.get("learner") or {}).get(key, 0) != (prev.get("learner") or {}).get(key, 0)
                        for key in LEARNER_TOTALS)
    return bool(now["running"] or now["queued"] or any(now[n] != prev[n] for n in COUNTERS) or learner_moved
                or (now.get("learner") or {}).get("training") or now.get("drafts") != prev.get("drafts"))


class StatsLine:
    """Logs format_stats every `interval` seconds on a daemon thread (`start` / `stop`), or at each `tick()`.

    read: () -> snapshot (read_engine with its arguments bound); extras: () -> {label: value} callables whose
    items join the line; clock: seconds (injectable for tests)."""

    def __init__(self, read: Callable[[], dict], interval: float, extras: tuple = (), clock=time.monotonic,
                 logger: logging.Logger = log):
        self.read, self.interval, self.extras, self.clock, self.log = read, float(interval), list(extras), clock, logger
        self._prev: dict | None = None
        self._at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def snapshot(self) -> dict:
        snap = self.read()
        extra: dict = {}
        for more in self.extras:
            try:
                extra.update(more())
            except Exception:
                self.log.exception("a stats line extra failed")
        return {**snap, "extra": extra}

    def tick(self) -> str | None:
        """Take a snapshot; log (and return) the line for the interval since the last tick, unless idle."""
        now, at = self.snapshot(), self.clock()
        prev, self._prev, dt, self._at = self._prev, now, at - self._at, at
        if prev is None or not active(prev, now):
            return None
        line = format_stats(prev, now, dt)
        self.log.info(line)
        return line

    def start(self) -> None:
        if self.interval <= 0 or self._thread is not None:
            return
        self.tick()  # the baseline
        self._thread = threading.Thread(target=self._run, name="osd-stats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:  # the line is a report: it never takes anything down
                self.log.exception("the stats line failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
