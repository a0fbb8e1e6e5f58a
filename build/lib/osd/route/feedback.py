"""Full-information feedback for the router: after a request, score EVERY draft on the target's output.

The target's output is known once a request finishes, so each draft's greedy acceptance on it follows from
one teacher-forced forward (as the fast replay measures, distill/evaluate.py): agreement of the draft's argmax
with the target's token at every output position; with greedy decoding that is exactly what speculative
steps accept position by position. The frozen trunk below the adapters runs once; each draft then runs only
its adapted top layers (AdapterDrafts.use), so scoring D drafts costs about trunk + D x top layers of one
prefill over prompt + output.

Budget (RouteConfig): a `score_share` of requests, drawn at random (a periodic choice would alias with an
interleaved stream), never more than share x requests + 1; and no scoring job starts unless the scoring seconds
so far plus a job's mean stay within `score_time_share` of serving seconds (checked when queued and when taken).
schedule "background" scores in idle windows on its own thread (the queue keeps the newest `MAX_PENDING`; older
ones are dropped and counted).
Limitations: scores the fp32 masters (a server proposes with their serving copies: int8 by default); for a
sampled request (T > 0) greedy agreement with the sampled output is a proxy for acceptance, not its value.
"""
from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from osd.learn.per_draft import served_draft
from osd.learn.trainable import head_logits_at, trunk_features
from osd.schedule.turns import end_thread_team

MAX_PENDING = 64
IDLE_POLL, MAX_IDLE_POLL = 0.005, 0.1  # seconds between busy polls: first, and at most (doubling after each busy one)


@torch.no_grad()
def score_drafts(drafts, names: list[str], prompt_ids: list[int], output_ids: list[int],
                 max_tokens: int = 1024) -> dict[str, list[bool]]:
    """Per draft: draft argmax == target token at each scored output position (teacher-forced, greedy).

    Keeps the last `max_tokens` of prompt + output (the output's head is dropped only when it alone is longer)."""
    if not output_ids:
        return {name: [] for name in names}
    tokens = (list(prompt_ids) + list(output_ids))[:-1][-max_tokens:]  # (T,) the last output token is never input
    cols = torch.arange(max(0, len(tokens) - len(output_ids)), len(tokens))  # logits at col predict the token after it
    truth = torch.tensor(list(output_ids)[len(output_ids) - len(cols):])  # (N,)
    rows = torch.zeros(len(cols), dtype=torch.long)
    with drafts.lock:
        master = drafts.master
        features = trunk_features(master, torch.tensor([tokens]), drafts.split)  # (1, T, H): no adapter below split
        out = {}
        for name in names:
            with drafts.use(name):
                logits = head_logits_at(master, features, drafts.split, rows, cols)  # (N, V)
            out[name] = (logits.argmax(-1) == truth).tolist()
    return out


def acceptance(matches: list[bool]) -> float:
    """Greedy agreement: the share of positions a draft would have proposed right."""
    return sum(matches) / len(matches) if matches else 0.0


class ScoreBudget:
    """Random draws at rate `share`, capped at share x seen + 1 (so never more than the budget, give or take one)."""

    def __init__(self, share: float, seed: int = 0):
        self.share, self.rng = share, random.Random(seed)
        self.seen = self.taken = 0

    def take(self) -> bool:
        self.seen += 1
        if self.taken + 1 <= self.share * self.seen + 1 and self.rng.random() < self.share:
            self.taken += 1
            return True
        return False


@dataclass
class _Job:
    features: torch.Tensor
    prompt_ids: list[int]
    output_ids: list[int]
    served: str


class RouteFeedback:
    """Observes finished requests; scores every draft on a budgeted share; teaches the router."""

    def __init__(self, router, drafts, config, engine_busy=lambda: False, clock=time.perf_counter):
        self.router, self.drafts, self.config = router, drafts, config
        self.engine_busy, self.clock = engine_busy, clock
        self.budget = ScoreBudget(config.score_share, config.route_seed + 1)
        self.pending: deque[_Job] = deque()
        self.counters = {"requests": 0, "scored": 0, "dropped": 0, "over_time_budget": 0, "served_best": 0,
                         "regret_sum": 0.0, "score_seconds": 0.0, "serving_seconds": 0.0}
        self.scored_alpha: dict[str, list[float]] = {}  # draft -> [sum of scored acceptances, requests scored]
        self._lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def after_request(self, result, decision=None) -> None:
        served = served_draft(result.draft[0])
        x = decision.features if decision is not None else self.router.featurize(result.prompt_ids)
        with self._lock:
            self.counters["requests"] += 1
            self.counters["serving_seconds"] += result.seconds
            over_time = not self._within_time_budget()
        if not result.token_ids or not self.budget.take():
            return
        if over_time:
            with self._lock:
                self.counters["over_time_budget"] += 1
            return
        self._enqueue(_Job(x, list(result.prompt_ids), list(result.token_ids), served))

    def _enqueue(self, job: _Job) -> None:
        with self._lock:
            if len(self.pending) >= MAX_PENDING:
                self.pending.popleft()
                self.counters["dropped"] += 1
            self.pending.append(job)
        if self.config.score_schedule == "sync":
            self.drain()
        else:
            self._wake.set()

    def _within_time_budget(self) -> bool:
        """(Under the lock.) One more scoring job fits: the seconds scoring took so far plus what a job takes on
        average stay within score_time_share of serving seconds. Checked when a job is queued and again when it is
        taken, so jobs queued while the engine was busy cannot overrun the budget together."""
        c = self.counters
        if self.config.score_time_share <= 0:
            return False
        expected = c["score_seconds"] / c["scored"] if c["scored"] else 0.0
        return c["score_seconds"] + expected <= self.config.score_time_share * c["serving_seconds"]

    def _take_job(self) -> _Job | None:
        """The oldest queued job that still fits the time budget (the ones that no longer fit are dropped and
        counted in over_time_budget), or None."""
        with self._lock:
            while self.pending:
                job = self.pending.popleft()
                if self._within_time_budget():
                    return job
                self.counters["over_time_budget"] += 1
            return None

    def drain(self) -> int:
        """Score every queued request that fits the time budget now; returns how many."""
        n = 0
        while (job := self._take_job()) is not None:
            self.score(job)
            n += 1
        return n

    def score(self, job: _Job) -> dict[str, float]:
        with self.drafts.lock:  # a draft's update holds it for seconds: waiting for it is not scoring's cost
            t0 = self.clock()
            names = [n for n in self.router.names() if n in self.drafts.names()]
            matches = score_drafts(self.drafts, names, job.prompt_ids, job.output_ids, self.config.score_max_tokens)
            rewards = {n: acceptance(m) for n, m in matches.items()}
            self.router.learn(job.features, rewards)
            spent = self.clock() - t0
        with self._lock:
            self.counters["score_seconds"] += spent
            self.counters["scored"] += 1
            if job.served in rewards:
                best = max(rewards.values())
                self.counters["served_best"] += rewards[job.served] >= best
                self.counters["regret_sum"] += best - rewards[job.served]
            for n, r in rewards.items():
                total = self.scored_alpha.setdefault(n, [0.0, 0])
                total[0] += r
                total[1] += 1
        return rewards

    # --- background schedule --------------------------------------------------------------------
    def start(self) -> None:
        if self.config.score_schedule != "background" or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="osd-route-feedback", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            while not self._stop.is_set() and self.pending:
                poll = IDLE_POLL
                while self.engine_busy() and not self._stop.is_set():  # idle windows only; each wake takes the GIL
                    self._stop.wait(poll)  # from the serving thread: backed off as learn/idle.py does
                    poll = min(2 * poll, MAX_IDLE_POLL)
                job = self._take_job()
                if job is not None:
                    try:
                        self.score(job)
                    except Exception:  # a failed scoring never takes serving down; counted as dropped
                        with self._lock:
                            self.counters["dropped"] += 1
                    finally:  # this thread's OpenMP team must not outlive its work (schedule/turns.py)
                        end_thread_team()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "pending": len(self.pending),
                    "scored_alpha": {n: s / max(1, k) for n, (s, k) in self.scored_alpha.items()},
                    "scored_alpha_sums": {n: list(v) for n, v in self.scored_alpha.items()}}
