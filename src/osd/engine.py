"""The speculative engine: one target, its proposer, the k policies and the scheduler that runs the step loop
(schedule/scheduler.py: schedule -> propose -> verify -> commit -> observe, PAPER.md section 1).

`generate` runs one request to the end (alone, or beside nothing else: it holds the engine's lock); the server's
worker drives the scheduler itself so that many requests share each step (serve/worker.py). Observers (metrics, the
online learner) receive every StepRecord, which already holds the target's logits at every position it verified:
learning from verification needs no extra target forward.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable

import torch

from osd.config import SamplingConfig, SpeculationConfig
from osd.errors import ContextTooLong, InvalidArgument
from osd.metrics import SpecCounters, SpecMetrics
from osd.models.runner import as_runner, eos_ids_of
from osd.models.slots import Feed, slots_for
from osd.propose.base import Proposer
from osd.propose.recycle import RankRates, RecycledTable
from osd.schedule.goodput import RowCosts, fit_pass_model
from osd.schedule.records import GenerationResult, StepRecord
from osd.schedule.scheduler import Scheduler
from osd.schedule.turns import Turns
from osd.speed_model import KPolicy, TargetCosts, curve_from_rounds

PASS_CONTEXT = 448  # cached tokens of the long passes `_pass_model` times (about a code request's prompt + answer)

__all__ = ["GenerationResult", "SpeculativeEngine", "StepRecord"]

RUNNERS_UP = 3  # the draft's next-best tokens offered as tree branches at each depth
RUNNER_UP_PRIOR = (0.25, 0.10, 0.05)  # chance each is the target's token where the draft's best is not, before evidence


class SpeculativeEngine:
    """Serves one target with one proposer, to one request at a time (`generate`) or to up to `spec.max_batch` at
    once (the scheduler, driven by serve/worker.py).

    A proposer may be a chain of sources tried in order (`proposer.sources`, e.g. the n-gram lookup, then
    the draft model): each source has its own k policy (its own acceptance and cost; verification costs
    are shared), and a step uses the first source whose policy asks for k > 0 and that finds tokens. Sequences
    beside the first use forks of the proposer (`proposer.fork()`: their own caches, the same drafts).
    Limitations: the target's rows share one pass only on osd's Q4 kernel (models/slots.py); the llama.cpp backend
    serves one sequence at a time.
    """

    def __init__(self, target, tokenizer, proposer: Proposer | None, spec: SpeculationConfig | None = None,
                 metrics: SpecMetrics | None = None, clock: Callable[[], float] = time.perf_counter):
        """target: a runner (models/runner.py: the torch CachedModel or the llama.cpp runner) or a torch causal LM."""
        self.spec = spec or SpeculationConfig()
        self.target = as_runner(target)
        self.tokenizer, self.proposer, self.clock = tokenizer, proposer, clock
        k_max = self.spec.k if proposer is not None else 0
        self.k_max = min(k_max, getattr(self.target, "max_rows", k_max + 1) - 1)  # verify only batch-invariant row counts
        self.sources = list(getattr(proposer, "sources", [proposer])) if proposer is not None else []
        self.slots = slots_for(self.target, self.spec.max_batch)
        tree = min(self.spec.tree, getattr(self.target, "max_rows", 1) - 1) if self.slots.supports_trees else 0
        for source in self.sources:  # with trees served, a draft names its runners-up too (forks inherit it)
            if hasattr(source, "runners_up") and tree:
                source.runners_up = RUNNERS_UP
        self.recycled = RecycledTable(self.target.vocab_size) if tree else None  # the target's top tokens, per token
        self.runner_up_rates = RankRates(RUNNER_UP_PRIOR, RUNNERS_UP) if tree else None  # the draft's next-best tokens
        self.tree_nodes = tree
        self.target_costs = TargetCosts(max(self.k_max, tree))  # rows up to a whole tree's are calibrated
        self.row_costs = RowCosts()  # seconds of one pass by total rows, several sequences sharing it
        self.policies = [KPolicy(self.k_max, self.spec.adaptive, self.spec.alpha_prior, self.spec.alpha_ema,
                                 costs=self.target_costs, upper_z=self.spec.alpha_upper_z,
                                 refresh_every=self.spec.cost_refresh_every) for _ in self.sources]
        self.metrics = metrics or SpecMetrics()
        self.observers: list[Callable[[StepRecord], None]] = []  # called after every step
        self.request_observers: list[Callable[[GenerationResult], None]] = []  # called after every request
        self.context_window = self.target.context_window
        self.vocab_size = self.target.vocab_size
        self.eos_ids = self.target.eos_ids | eos_ids_of(tokenizer)
        self.turns = Turns()  # the cores: a step, or a background learner's chunk, never both (schedule/turns.py)
        self.scheduler = Scheduler(self, self.spec.prefill_rows)
        self.lock = threading.Lock()  # one driver of the scheduler at a time (generate, or the server's worker)
        self.queued: Callable[[], int] = lambda: 0  # requests waiting for a place in the scheduler (the server's Worker)

    def generate(self, prompt_ids: list[int], sampling: SamplingConfig, request_id: str | None = None,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        self.check(prompt_ids, sampling)
        with self.lock:
            seq = self.scheduler.add(list(prompt_ids), sampling, request_id, on_text)
            while seq.result is None and seq.error is None:
                self.scheduler.step()
        if seq.error is not None:
            raise seq.error
        self.observe_request(seq.result)
        return seq.result

    def observe_request(self, result: GenerationResult) -> None:
        """Hand a finished request to the request observers (the lookup's traffic index, the router, the learner)."""
        for observe in self.request_observers:
            observe(result)

    def busy(self) -> bool:
        """True while a request is being decoded."""
        return self.lock.locked() or bool(self.scheduler.running)

    def pressure(self) -> bool:
        """True while a request waits for its first token: queued for a place, or its prompt still prefilling. (Read
        from another thread without the lock: a heuristic for the learner's budget, learn/budget.py.)"""
        return self.queued() > 0 or any(len(s.tokens) <= len(s.prompt) for s in list(self.scheduler.running))

    def set_adaptive(self, adaptive: bool) -> None:
        """Adaptive k on/off for every source (off: each step proposes k = spec.k, capped by the tokens left)."""
        for policy in self.policies:
            policy.adaptive = adaptive

    @staticmethod
    def describe_calibration(calibration: dict) -> str:
        """One line of what `calibrate` measured, what the k policy and the scheduler's goodput decide from: a target
        pass by rows against one row, each draft's token against one target row (c)."""
        t = calibration["t_target"]
        rows = ", ".join(f"{n} rows {v:.2f}x" for n, v in enumerate(calibration["verify_cost"][1:], start=2))
        drafts = ", ".join(f"{d * 1e3:.2f} ms (c {d / t[0]:.3f})" for d in calibration["t_draft_by_source"])
        model = calibration.get("pass_model")
        company = (f"; in company, a pass +{model['per_sequence'] * 1e3:.1f} ms a sequence, and per 1000 cached tokens "
                   f"+{model['per_sequence_context'] * 1e6:.1f} ms a sequence, +{model['per_row_context'] * 1e6:.1f} ms"
                   " a row") if model else ""
        return f"calibrated: a target pass of 1 row {t[0] * 1e3:.1f} ms" + (f", {rows}" if rows else "") + \
            (f"; a draft token {drafts}" if drafts else "") + company

    def _row_seconds(self, prefix: list[int], measured: dict[int, float], repeats: int) -> dict[int, float]:
        """Seconds of one pass by rows for the scheduler's goodput (schedule/goodput.py), up to what a full step holds:
        every sequence at k_max plus a prefill chunk. Measured on one sequence (a pass's cost is its matrices' rows),
        every row with its logits as a decoding sequence's rows have (the LM head is ~15% of a row's weights here:
        rows timed without it made proposals under load look cheaper than they are)."""
        most = self.scheduler.capacity * (self.k_max + 1) + self.spec.prefill_rows
        step = getattr(self.target, "rows_per_pass", 0)  # a kernel that runs rows in passes: one row more than a pass
        passes = {n for p in range(step, 5 * step, step) for n in (p, p + 1)} if step else set()  # is a pass more
        counts = sorted(({n for n in (12, 16, 24, 32, 48, 64, 96, 128, 192, 256, *passes) if n <= most} | {most})
                        - set(measured))
        seconds = dict(measured)  # the counts calibrate's rounds measured already
        self.target.reset()
        self.target.feed(prefix)
        for n in counts:
            best = float("inf")
            for _ in range(repeats + 1):
                t0 = self.clock()
                self.target.feed([prefix[-1]] * n, n_logits=n)
                best = min(best, self.clock() - t0)
                self.target.rollback(len(prefix))
            seconds[n] = best
        return seconds

    def _pass_model(self, base_context: int, row_seconds: dict[int, float], repeats: int) -> dict:
        """What the sequences of a pass add to its rows' cost (schedule/goodput.py RowCosts): the same passes (1, 2
        and up to 4 sequences, 1 to k_max + 1 rows each) over the scheduler's slots at a long context (PASS_CONTEXT
        cached tokens, or what the slots hold) and at the short one the rows curve was measured at, so that the
        context's terms rest on differences of like passes, not on the curve's own noise; fitted by
        `fit_pass_model`. The slots are emptied after."""
        slots, n = self.slots, min(4, self.scheduler.capacity)
        long = min(PASS_CONTEXT, (self.context_window or PASS_CONTEXT + self.k_max + 2) - self.k_max - 2)
        tokens = torch.randint(0, min(self.vocab_size, 1000), (max(long, base_context),),
                               generator=torch.Generator().manual_seed(1)).tolist()
        curve = RowCosts()
        curve.calibrate(row_seconds)
        passes = []
        for context in sorted({base_context, long} if long > 2 * base_context else {base_context}):
            for slot in range(n):
                slots.reset(slot)
                if slot and getattr(slots, "exclusive", False) and hasattr(slots, "copy_prefix"):
                    slots.copy_prefix(0, slot, context)  # the same keys/values, in the slot's own cache
                else:
                    slots.feed([Feed(slot, tokens[:context], 0)])
            shapes = sorted({(1, 1), (1, 4), (1, self.k_max + 1), (2, 1), (2, 4), (n, 1), (n, 2)})
            for sequences, rows in shapes:
                best = float("inf")
                for _ in range(repeats + 1):
                    t0 = self.clock()
                    slots.feed([Feed(slot, tokens[:rows], rows) for slot in range(sequences)])
                    best = min(best, self.clock() - t0)
                    for slot in range(sequences):
                        slots.rollback(slot, context)
                passes.append(([context] * sequences, sequences * rows, best))
        for slot in range(n):
            slots.reset(slot)
        self.scheduler.forget_held()
        return fit_pass_model(passes, curve.curve, base_context)

    def _draft_seconds(self, proposer, dummy: list[int]) -> tuple[float, float]:
        """-> (median seconds of one single-token draft forward, seconds per token of a catch-up feed): ~0 for
        sources without forwards (the lookup). A catch-up feed is what a draft whose cache lags (a prompt it was not
        fed, tokens committed while it did not propose) pays before its first proposal: ~0.5 ms a token for the
        cheap draft on the AMD machine, a quarter of a single-token forward."""
        greedy = SamplingConfig(max_new_tokens=1)

        def propose(tokens: list[int], k: int):
            if getattr(proposer, "reads_target_features", False):  # a feature head: a made-up feature to read
                proposer.observe_feature(len(tokens) - 2, torch.zeros(proposer.width))
            return proposer.propose(tokens, k, greedy)

        proposer.begin(dummy)
        propose(dummy, 1)  # prefill
        propose(dummy + [0], 2)  # warm-up
        proposer.rollback(len(dummy))
        t0 = self.clock()
        proposal = propose(dummy + [0], 8)  # first forward feeds 1 token
        timings = proposal.single_token_seconds or [(self.clock() - t0) / max(proposal.k, 1)]
        t_draft = sorted(timings)[len(timings) // 2]  # median: robust to a noisy neighbour
        proposer.rollback(1)
        t0 = self.clock()
        propose(dummy + [0], 1)  # feeds len(dummy) tokens in one forward (a head: none, it has no cache)
        t_catch_up = max(0.0, self.clock() - t0 - t_draft) / max(len(dummy) - 1, 1)
        return t_draft, t_catch_up

    def check(self, prompt_ids, sampling: SamplingConfig) -> None:
        if not isinstance(sampling, SamplingConfig):
            raise InvalidArgument("sampling must be a SamplingConfig")
        if len(prompt_ids) == 0:
            raise InvalidArgument("prompt is empty: give at least one token")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in prompt_ids):
            raise InvalidArgument(f"prompt holds token ids outside the vocabulary [0, {self.vocab_size})")
        if any(t >= self.vocab_size for t in sampling.stop_token_ids):
            raise InvalidArgument(f"stop_token_ids holds token ids outside the vocabulary [0, {self.vocab_size})")
        if self.context_window and len(prompt_ids) + sampling.max_new_tokens > self.context_window:
            raise ContextTooLong(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                f"target's context window of {self.context_window} tokens"
            )

    @torch.inference_mode()
    def calibrate(self, context_len: int = 64, repeats: int = 6) -> dict:
        """Warm up and measure draft/target forward costs; feeds the k policy. Returns seconds.

        Target: each row count n = 1..k_max+1 (with company, also the kernel's pass of rows and one row past it, where
        the curve bends) is fed after the same prefix and rolled back, in rounds that take every n in turn (one
        untimed warm-up round, then `repeats` + 1 timed ones); each count's cost is its ratio to the same round's one
        row, the median over rounds, times the fastest one row (speed_model.py `curve_from_rounds`: why, and how
        repeatable). These passes are cheap (~0.6 s a round on the bundled 1.5B); the larger counts and the pass model
        take min(repeats, 2) + 1 timed passes each, the fastest."""
        dummy = [int(t) for t in torch.randint(0, min(self.vocab_size, 1000), (context_len,), generator=torch.Generator().manual_seed(0))]
        rows = list(range(1, self.target_costs.k_max + 2))
        step = getattr(self.target, "rows_per_pass", 0) if self.scheduler.capacity > 1 else 0
        near = sorted(set(rows) | ({step, step + 1} if step else set()))  # the bend of a kernel that runs rows in passes
        prefix = max(1, context_len - near[-1])
        self.target.reset()
        self.target.feed(dummy[:prefix])
        rounds = []
        for round_ in range(repeats + 2):  # round 0: warm-up
            timed = {}
            for n in near:
                t0 = self.clock()
                self.target.feed(((dummy[prefix:] or dummy[-1:]) * n)[:n], n_logits=n)
                timed[n] = self.clock() - t0
                self.target.rollback(prefix)
            rounds += [timed] if round_ else []
        best = curve_from_rounds(rounds)  # each round's ratios to its own one row, the median (speed_model.py)
        t_target = [best[n] for n in rows]
        drafts = [self._draft_seconds(proposer, dummy) for proposer in self.sources] if self.target_costs.k_max else []
        few = min(repeats, 2)  # the larger passes: up to a second each
        row_seconds = self._row_seconds(dummy[:prefix], best, few) if self.scheduler.capacity > 1 else None
        self.target.reset()
        pass_model = self._pass_model(prefix, row_seconds, few) if row_seconds else None
        t_drafts = [t for t, _ in drafts]
        t_draft = max(t_drafts, default=0.0)
        calibration = {"t_draft": t_draft, "t_draft_by_source": t_drafts, "t_catch_up_by_source": [t for _, t in drafts],
                       "t_target": t_target, "c": t_draft / t_target[0],
                       "verify_cost": [t / t_target[0] for t in t_target], "row_seconds": row_seconds,
                       "pass_model": pass_model, "rounds": rounds}  # (rounds: the timed passes, for osd bench calibration)
        self.apply_calibration(calibration)
        return calibration

    def apply_calibration(self, calibration: dict) -> None:
        """Feed measured costs (`calibrate`'s dict, or one an earlier server wrote: `osd serve --calibration FILE`) to
        the k policies and the scheduler's goodput. A dict measured for other row counts or draft sources is refused:
        its costs would be read against the wrong rows or drafts."""
        sources = len(self.policies) if self.target_costs.k_max else 0
        if len(calibration["t_target"]) != self.target_costs.k_max + 1 or \
                len(calibration["t_draft_by_source"]) != sources:
            raise InvalidArgument(
                f"a calibration of {len(calibration['t_target'])} target row counts and "
                f"{len(calibration['t_draft_by_source'])} draft sources does not fit this engine "
                f"({self.target_costs.k_max + 1} row counts, {sources} sources): measure it again")
        if calibration.get("row_seconds") and self.scheduler.capacity > 1:
            self.row_costs.calibrate({int(n): t for n, t in calibration["row_seconds"].items()},
                                     calibration.get("pass_model"))
        self.target_costs.calibrate(calibration["t_target"])
        for policy, t_draft, t_catch_up in zip(self.policies, calibration["t_draft_by_source"],
                                               calibration["t_catch_up_by_source"]):
            policy.calibrate(t_draft, t_catch_up=t_catch_up)


CALIBRATION_KEYS = {"t_target", "verify_cost", "t_draft_by_source", "t_catch_up_by_source"}  # what applying reads


def calibrate_or_load(engine: SpeculativeEngine, path: str | None) -> tuple[dict, str]:
    """The engine's costs from `path` when that file exists (`apply_calibration`), else measured (`calibrate`) and
    written to `path` if one is given (whole or not at all) -> (the calibration, where it came from: "measured" or the
    path). Read from a file, no warm-up passes run: the first request pays them."""
    if path and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                calibration = json.load(f)
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"calibration file {path} could not be read ({e}): remove it to measure again") from e
        if not isinstance(calibration, dict) or not CALIBRATION_KEYS <= calibration.keys():
            raise InvalidArgument(f"calibration file {path} is not a calibration osd wrote (it needs "
                                  f"{sorted(CALIBRATION_KEYS)}): remove it to measure again")
        engine.apply_calibration(calibration)
        return calibration, path
    calibration = engine.calibrate()
    if path:
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            json.dump(calibration, f)
        os.replace(f"{path}.tmp", path)  # a server reading it never sees half a file
    return calibration, "measured"
