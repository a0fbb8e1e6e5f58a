"""The speculative decoding step loop: propose -> verify -> commit -> observe (PAPER.md section 1).

One request at a time (batch size 1). Observers (metrics, the online learner) receive every
StepRecord, which already holds the target's logits at every position it verified: learning from
verification needs no extra target forward.
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from osd.config import SamplingConfig, SpeculationConfig
from osd.errors import ContextTooLong, InvalidArgument
from osd.metrics import SpecCounters, SpecMetrics
from osd.models.runner import as_runner, eos_ids_of
from osd.propose.base import Proposal, Proposer
from osd.speed_model import KPolicy, TargetCosts
from osd.stopping import StopChecker
from osd.verify import acceptance_beta, greedy_verify, rejection_verify, warp_probs


@dataclass
class StepRecord:
    """Everything one verification step knows; what the learner and metrics observe."""

    request_id: str
    draft: tuple[str, int]  # (draft name, version) that proposed
    context: list[int]  # committed tokens before the step; proposal i sits at position len(context)+i
    proposed: list[int]  # (k,) draft tokens
    n_accepted: int
    next_token: int  # recovered (n_accepted < k) or bonus token
    target_logits: torch.Tensor  # (k+1, V) raw target logits; row i predicts proposal i (row k: bonus)
    draft_probs: torch.Tensor | None  # (k, V) warped draft probabilities (sampling only)
    betas: list[float]  # exact acceptance probability at each on-trajectory proposal
    temperature: float
    t_draft: float
    t_target: float
    draft_weights: str | None = None  # fingerprint of the weights this step's proposal ran with (Proposal.weights)


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    draft: tuple[str, int]
    counters: SpecCounters
    seconds: float
    steps: list[tuple[int, int]] = field(default_factory=list)  # (k, n_accepted) per step
    prefill_seconds: float = 0.0  # of `seconds`: feeding the prompt before the first step

    @property
    def stats(self) -> dict:
        s = self.counters.summary()
        s.update(draft=self.draft[0], draft_version=self.draft[1], seconds=self.seconds,
                 new_tokens=len(self.token_ids), wall_tokens_per_second=len(self.token_ids) / self.seconds if self.seconds else None)
        return s


class SpeculativeEngine:
    """Serves one target with one proposer. Limitations: batch size 1; requests are serialised.

    A proposer may be a chain of sources tried in order (`proposer.sources`, e.g. the n-gram lookup, then
    the draft model): each source has its own k policy (its own acceptance and cost; verification costs
    are shared), and a step uses the first source whose policy asks for k > 0 and that finds tokens.
    """

    def __init__(self, target, tokenizer, proposer: Proposer | None, spec: SpeculationConfig | None = None,
                 metrics: SpecMetrics | None = None, clock: Callable[[], float] = time.perf_counter):
        """target: a runner (models/runner.py: the torch CachedModel or the llama.cpp runner) or a torch causal LM."""
        self.spec = spec or SpeculationConfig()
        self.target = as_runner(target)
        self.tokenizer, self.proposer, self.clock = tokenizer, proposer, clock
        k_max = self.spec.k if proposer is not None else 0
        k_max = min(k_max, getattr(self.target, "max_rows", k_max + 1) - 1)  # verify only batch-invariant row counts
        self.sources = list(getattr(proposer, "sources", [proposer])) if proposer is not None else []
        self.target_costs = TargetCosts(k_max)
        self.policies = [KPolicy(k_max, self.spec.adaptive, self.spec.alpha_prior, self.spec.alpha_ema,
                                 costs=self.target_costs, upper_z=self.spec.alpha_upper_z,
                                 refresh_every=self.spec.cost_refresh_every) for _ in self.sources]
        self.metrics = metrics or SpecMetrics()
        self.observers: list[Callable[[StepRecord], None]] = []  # called after every step
        self.request_observers: list[Callable[[GenerationResult], None]] = []  # called after every request
        self.context_window = self.target.context_window
        self.vocab_size = self.target.vocab_size
        self.eos_ids = self.target.eos_ids | eos_ids_of(tokenizer)
        self._lock = threading.Lock()

    def generate(self, prompt_ids: list[int], sampling: SamplingConfig, request_id: str | None = None,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        self._check(prompt_ids, sampling)
        with self._lock:
            result = self._generate(list(prompt_ids), sampling, request_id or uuid.uuid4().hex[:12], on_text)
        for observe in self.request_observers:
            observe(result)
        return result

    def busy(self) -> bool:
        """True while a request is being decoded."""
        return self._lock.locked()

    def _generate(self, tokens, sampling, request_id, on_text) -> GenerationResult:
        start = self.clock()
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        stopper = StopChecker(self.tokenizer, self.eos_ids, sampling.max_new_tokens, sampling.stop)
        counters, steps, prompt, sent = SpecCounters(requests=1), [], list(tokens), ""
        self.target.reset()
        if len(tokens) > 1:
            self.target.feed(tokens[:-1])  # prefill; the last prompt token is fed with the first proposal
        draft = ("none", -1)
        if self.proposer is not None:
            self.proposer.begin(tokens)  # the draft's snapshot and its own prompt prefill
            draft = (self.proposer.name, self.proposer.version)
            for source, policy in zip(self.sources, self.policies):  # a new draft version: probe it soon
                policy.on_draft_version(getattr(source, "version", None))
        prefill_seconds = self.clock() - start  # target and draft prompt prefill
        while stopper.finish_reason is None:
            t0 = self.clock()
            proposal, source = self._propose(tokens, sampling.max_new_tokens - len(stopper.token_ids), sampling, generator)
            k = proposal.k
            t1 = self.clock()
            target_logits = self.target.feed(tokens[self.target.length:] + proposal.tokens, n_logits=k + 1)  # (k+1, V)
            t2 = self.clock()
            outcome, betas = self._verify(target_logits, proposal, sampling, generator)
            emitted = proposal.tokens[: outcome.n_accepted] + [outcome.next_token]
            record = StepRecord(request_id, draft, tokens[:], proposal.tokens, outcome.n_accepted, outcome.next_token,
                                target_logits, proposal.draft_probs, betas, sampling.temperature, t1 - t0,
                                t2 - t1, proposal.weights) if self.observers else None  # the context copy only when someone observes
            tokens += emitted
            self.target.rollback(len(tokens) - 1)  # keep the accepted prefix; the last token is pending
            if k:
                self._rollback_sources(len(tokens) - 1)
            self.target_costs.observe(k, t2 - t1)
            if source is not None:
                source.observe(k, outcome.n_accepted, proposal.single_token_seconds or [])
            counters.add_step(k, outcome.n_accepted, len(emitted), betas, t1 - t0, t2 - t1)
            steps.append((k, outcome.n_accepted))
            for observe in self.observers:
                observe(record)
            stopper.extend(emitted)
            if on_text is not None and len(text := stopper.stable_text()) > len(sent):
                on_text(text[len(sent):])
                sent = text
        self.metrics.record(draft, counters)
        return GenerationResult(request_id, prompt, stopper.token_ids, stopper.text, stopper.finish_reason, draft,
                                counters, self.clock() - start, steps, prefill_seconds)

    def _propose(self, tokens, remaining: int, sampling: SamplingConfig, generator) -> tuple[Proposal, KPolicy | None]:
        """The first source whose policy asks for k > 0 and that finds tokens; (no proposal, None) when none does."""
        for proposer, policy in zip(self.sources, self.policies):
            k = policy.choose_k(remaining)
            if k and (proposal := proposer.propose(tokens, k, sampling, generator)).k:
                return proposal, policy
        return Proposal([]), None

    def _rollback_sources(self, length: int) -> None:
        for proposer in self.sources:
            proposer.rollback(length)

    def set_adaptive(self, adaptive: bool) -> None:
        """Adaptive k on/off for every source (off: each step proposes k = spec.k, capped by the tokens left)."""
        for policy in self.policies:
            policy.adaptive = adaptive

    def _draft_seconds(self, proposer, dummy: list[int]) -> float:
        """Median seconds of one single-token draft forward (~0 for sources without forwards, e.g. lookup)."""
        proposer.begin(dummy)
        greedy = SamplingConfig(max_new_tokens=1)
        proposer.propose(dummy, 1, greedy)  # prefill
        proposer.propose(dummy + [0], 2, greedy)  # warm-up
        proposer.rollback(len(dummy))
        t0 = self.clock()
        proposal = proposer.propose(dummy + [0], 8, greedy)  # first forward feeds 1 token
        timings = proposal.single_token_seconds or [(self.clock() - t0) / max(proposal.k, 1)]
        return sorted(timings)[len(timings) // 2]  # median: robust to a noisy neighbour

    def _verify(self, target_logits, proposal: Proposal, sampling: SamplingConfig, generator):
        """-> (VerifyOutcome, betas): greedy or lossless rejection sampling, plus exact acceptance."""
        draft_tokens = torch.tensor(proposal.tokens, dtype=torch.long)  # (k,)
        k = proposal.k
        if sampling.greedy:
            outcome = greedy_verify(target_logits, draft_tokens)
            on_path = min(outcome.n_accepted + 1, k)
            return outcome, [1.0] * outcome.n_accepted + [0.0] * (on_path - outcome.n_accepted)
        target_probs = warp_probs(target_logits, sampling.temperature, sampling.top_k, sampling.top_p)  # (k+1, V)
        if k == 0:
            return rejection_verify(target_probs, target_probs[:0], draft_tokens, generator), []
        outcome = rejection_verify(target_probs, proposal.draft_probs, draft_tokens, generator)
        on_path = min(outcome.n_accepted + 1, k)
        return outcome, acceptance_beta(target_probs[:on_path], proposal.draft_probs[:on_path]).tolist()

    def _check(self, prompt_ids, sampling: SamplingConfig) -> None:
        if not isinstance(sampling, SamplingConfig):
            raise InvalidArgument("sampling must be a SamplingConfig")
        if len(prompt_ids) == 0:
            raise InvalidArgument("prompt is empty: give at least one token")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in prompt_ids):
            raise InvalidArgument(f"prompt holds token ids outside the vocabulary [0, {self.vocab_size})")
        if self.context_window and len(prompt_ids) + sampling.max_new_tokens > self.context_window:
            raise ContextTooLong(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                f"target's context window of {self.context_window} tokens"
            )

    @torch.inference_mode()
    def calibrate(self, context_len: int = 64, repeats: int = 2) -> dict:
        """Warm up and measure draft/target forward costs; feeds the k policy. Returns seconds.

        Target: each row count n = 1..k_max+1 is fed after the same prefix and rolled back, in rounds that take
        every n in turn (one untimed warm-up round, then `repeats` + 1 timed ones; the fastest per n). A slow spell
        of the machine then falls on every row count alike instead of on one, whose ratios it would skew (seen: a
        1-row timing 20% slow made 2-4 rows look 1.07-1.32x one row instead of 1.23-1.60x)."""
        dummy = [int(t) for t in torch.randint(0, min(self.vocab_size, 1000), (context_len,), generator=torch.Generator().manual_seed(0))]
        rows = range(1, self.target_costs.k_max + 2)
        prefix = max(1, context_len - rows[-1])
        self.target.reset()
        self.target.feed(dummy[:prefix])
        t_target = [float("inf")] * len(rows)
        for round_ in range(repeats + 2):  # round 0: warm-up
            for n in rows:
                t0 = self.clock()
                self.target.feed(((dummy[prefix:] or dummy[-1:]) * n)[:n], n_logits=n)
                seconds = self.clock() - t0
                self.target.rollback(prefix)
                if round_:
                    t_target[n - 1] = min(t_target[n - 1], seconds)
        t_drafts = [self._draft_seconds(proposer, dummy) for proposer in self.sources] if self.target_costs.k_max else []
        self.target.reset()
        self.target_costs.calibrate(t_target)
        for policy, t_draft in zip(self.policies, t_drafts):
            policy.calibrate(t_draft)
        t_draft = max(t_drafts, default=0.0)
        return {"t_draft": t_draft, "t_draft_by_source": t_drafts, "t_target": t_target, "c": t_draft / t_target[0],
                "verify_cost": [t / t_target[0] for t in t_target]}
