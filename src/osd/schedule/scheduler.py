"""The step loop over many sequences: schedule -> propose -> verify -> commit -> observe (PAPER.md section 1).

Every running sequence advances in one step: each decoding sequence's pending token plus its proposals, and chunks
of the prompts still being fed (chunked prefill), go through the target in one pass over each weight matrix
(models/slots.py); attention stays per sequence on its own cache slot. New requests join between steps (`add`) and
finished ones leave (continuous batching); a cancelled or failed sequence leaves without touching the others.

k per sequence: alone, the engine's per-source policies choose exactly as they do for one request (speed_model.py
KPolicy: probes, refreshes); with company, `allocate_k` (schedule/goodput.py) maximises the step's goodput from each
sequence's live acceptance and the measured cost of a pass by rows, so speculation backs off where the machine is
saturated. Sources that cost nothing to ask (the n-gram lookup) propose first, where this sequence accepts their
tokens at least as often as the draft model's behind them (`_outranked`); a draft model proposes after the
allocation, with the k it was given. With company, no sequence proposes in a step that feeds prompt rows: such a step
is compute-bound (16-256 prompt rows), where a proposal row costs a full row's share and takes a prompt row's place,
and a prompt row is one row of work done where a proposal row is worth its acceptance (< 1). (`osd bench serve-vs` on
the AMD machine, 4 clients: 0.78x osd target-only proposing beside prompt rows, `bench-serve-vs-teams.json`; 0.91x
not, `bench-serve-vs-noprop-prefill.json`.)

Lossless per request: a sequence's rows are computed bitwise as if it ran alone (Q4Slots; RunnerSlots feeds each
slot on its own), and acceptance runs per sequence with its own generator, so a greedy answer is the one the request
gets alone whatever shares its steps, and sampled output keeps its law (tests/schedule/).
A source that reads the target's features (the feature head, propose/feature_head.py) gets after each verification
the target's feature at the row that chose the sequence's pending token, from the same pass (models/slots.py).
The draft forwards of the sequences that propose run as one per depth (`propose_together`: one pass over the draft's
weights for all of them, where the draft runs on the compiled glue runner), each sequence picking from its own row.
Limitations: a draft on the transformers runner drafts per sequence (one forward per sequence per token); a
proposer that cannot fork (several routed drafts, a frozen runner draft) serves one sequence at a time; an error in
the shared target pass fails every sequence in that step (each gets the error).
"""
from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from osd.config import SamplingConfig
from osd.errors import InvalidArgument
from osd.schedule.records import GenerationResult, StepRecord
from osd.models.slots import Feed
from osd.propose.base import Proposal, forkable
from osd.propose.draft_model import DraftModelProposer, propose_together
from osd.propose.tree import grow_tree
from osd.schedule.goodput import allocate_k, amortized_catch_up
from osd.schedule.prefix import choose_slot, common_prefix
from osd.schedule.sequence import LiveAlpha, Sequence
from osd.stopping import StopChecker
from osd.verify.acceptance import VerifyOutcome, acceptance_beta
from osd.verify.logprobs import token_logprobs
from osd.verify.sampling import warp
from osd.verify.step import verify_proposal
from osd.verify.tree import greedy_tree_verify, sampled_tree_verify

ALONE_PREFILL_ROWS = 512  # prompt rows per step while no sequence decodes (Q4Slots runs them in chunk_rows chunks)
MIN_PREFILL_ROWS = 16  # prompt rows per step however many decode rows share it: a prompt always advances
MAX_PREFILL_ROWS = 256  # prompt rows per step beside decoding sequences, however many prompts wait
PROBE_EVERY = 16  # with company, the batch probes about once in this many steps (evidence for a better draft version)
FREE_SECONDS = 1e-4  # a source whose proposal costs less than this per token is asked before the allocation
CAUGHT_UP = 2  # a draft whose cache lags by at most this many tokens drafts ahead of the allocation (confidence.py)
DRAFT_AHEAD_CHANCE = 0.3  # drafting ahead goes on while the chance of the tokens so far all accepted stays >= this


def _costs_nothing(policy) -> bool:
    """A source whose proposals cost (next to) nothing: asked before the allocation (the n-gram lookups)."""
    return policy.t_draft is not None and policy.t_draft < FREE_SECONDS


def catch_up_seconds(source, policy, tokens: list[int]) -> float:
    """What a proposal from `source` would first feed: the tokens its draft cache lags by, at the policy's calibrated
    seconds per token (0 for a source without a cache, the lookup)."""
    return source.lag(tokens) * policy.t_catch_up if hasattr(source, "lag") else 0.0


class Ask(NamedTuple):
    """What the allocation knows of one decoding sequence's next proposal (`_ask_free_sources`)."""
    source: int | None  # index of the source that will propose (None: no source can)
    proposal: Proposal | None  # a free source's proposal, made already (None: a draft proposes after the allocation)
    alpha: float | list[float]  # the sequence's live acceptance for that source, or a drafted proposal's chain
    draft_seconds: float  # per proposed token (0 for a free source)
    catch_up_seconds: float  # this step's share of what a lagging draft cache feeds before proposing (goodput.py)
    cap: int  # the most tokens it may propose


@dataclass
class StepStats:
    """Counters of the scheduler's steps (rates derived when read)."""
    steps: int = 0
    rows: int = 0
    decode_rows: int = 0
    prefill_rows: int = 0
    seconds: float = 0.0
    emitted: int = 0
    accepted: int = 0
    sequence_steps: int = 0
    proposed: int = 0
    last_rows: int = 0
    last_seconds: float = 0.0
    reused_rows: int = 0  # prompt tokens whose keys/values a slot held already (prefix reuse)
    decode_seconds: float = 0.0  # passes with decoding rows
    speculable_seconds: float = 0.0  # ... of them, those where a sequence may propose (no prompt rows beside it)
    tree_shapes: Counter = field(default_factory=Counter)  # nodes per depth of each verified tree -> steps


class Scheduler:
    """The running sequences of one engine and the step that advances them all."""

    def __init__(self, engine, prefill_rows: int = 64):
        self.engine, self.slots = engine, engine.slots
        self.prefill_rows = int(prefill_rows)
        self.running: list[Sequence] = []
        self.stats = StepStats()
        self.capacity = self.slots.n_slots if engine.proposer is None or forkable(engine.proposer) else 1
        self._free = list(range(self.capacity))
        self._outranked_asks = Counter()  # source index -> times a free source left its turn to a draft (`_outranked`)
        self._proposers = {0: engine.proposer}  # slot -> its proposer: slot 0 the engine's own, the others forks
        self._held: dict[int, list[int]] = {}  # slot -> the tokens its cache holds (exclusive slots only)
        self.keeps_features = any(getattr(s, "reads_target_features", False) for s in engine.sources)
        if self.keeps_features:  # a feature head proposes: the target's pass hands back its features too
            if not getattr(self.slots, "supports_features", False):
                raise InvalidArgument("a feature head reads the target's features, which only osd's Q4 backend hands "
                                      f"back (--target-backend osd); this target runs on {type(engine.target).__name__}")
            self.slots.keep_features = True

    # ------------------------------------------------------------------------------------------ admission
    def add(self, prompt_ids: list[int], sampling: SamplingConfig, request_id: str | None = None,
            on_text=None) -> Sequence:
        """Admit a request (checked first: a bad one raises here and touches nothing); it runs from the next step."""
        e = self.engine
        e.check(prompt_ids, sampling)
        if not self._free:
            raise RuntimeError("no free sequence slot: add only while len(running) < capacity")
        with e.turns.serving():  # the draft's prompt prefill: never beside a background chunk (schedule/turns.py)
            return self._admit(prompt_ids, sampling, request_id, on_text)

    def _admit(self, prompt_ids, sampling: SamplingConfig, request_id: str | None, on_text) -> Sequence:
        e = self.engine
        slot, reused = self._slot_for(prompt_ids)
        try:
            start = e.clock()
            generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
            proposer = self._proposer(slot)
            stop_ids = (set() if sampling.ignore_eos else e.eos_ids) | set(sampling.stop_token_ids)
            seq = Sequence(request_id or uuid.uuid4().hex[:12], list(prompt_ids), sampling, slot, proposer,
                           StopChecker(e.tokenizer, stop_ids, sampling.max_new_tokens, sampling.stop), generator,
                           on_text, start, list(prompt_ids), cached_tokens=reused,
                           logprobs=[] if sampling.logprobs is not None else None)
            self.slots.rollback(slot, reused) if reused else self.slots.reset(slot)
            if proposer is not None:
                # the draft's snapshot (one version per request); its prompt prefill now only for a request that
                # starts alone: beside others, under load, it may never be asked to propose (the first proposal
                # feeds whatever the draft's cache lacks)
                proposer.begin(seq.tokens, prefill=not self.running)
                seq.draft = (proposer.name, proposer.version)
                seq.sources = list(getattr(proposer, "sources", [proposer]))
                for source, policy in zip(seq.sources, e.policies):  # a new draft version: probe it soon
                    policy.on_draft_version(getattr(source, "version", None))
        except BaseException:  # the slot goes back free, holding what is now sure: the prompt's first `reused`
            self._held[slot] = list(prompt_ids[:reused])  # tokens (a copied prefix overwrote what it held before)
            self._free.insert(0, slot)
            raise
        self.stats.reused_rows += reused
        seq.alphas = [LiveAlpha() for _ in seq.sources]
        seq.prefill_seconds = e.clock() - start
        self.running.append(seq)
        return seq

    def _slot_for(self, prompt: list[int]) -> tuple[int, int]:
        """A free slot, taken from the free list -> (slot, prompt tokens its cache holds already). Prefix reuse: the
        longest prefix of the prompt (all but its last token, which is fed with the first proposals) that a slot's
        cache holds, free or running; its keys/values at those positions are bitwise what feeding them again would
        give (rows are computed independently), so the request's output is unchanged and its prefill shorter
        (llama.cpp's server does the same per slot). Which free slot it takes, and when the prefix is copied
        (`copy_prefix`, where the slots offer it) rather than reused in place: schedule/prefix.py."""
        if not self.slots.exclusive:
            return self._free.pop(0), 0
        free = {slot: self._held.get(slot, []) for slot in self._free}
        if not hasattr(self.slots, "copy_prefix"):  # in place only: the free slot holding the longest prefix
            counts = [common_prefix(held, prompt[:-1]) for held in free.values()]
            best = counts.index(max(counts))
            return self._free.pop(best), counts[best]
        running = {s.slot: s.tokens[: self.slots.length(s.slot)] for s in self.running}
        slot, donor, n = choose_slot(free, running, prompt)
        if donor != slot:
            self.slots.copy_prefix(donor, slot, n)  # checks first: a refusal leaves the slot free and as it was
        self._free.remove(slot)
        return slot, n

    def _proposer(self, slot: int):
        if slot not in self._proposers:
            self._proposers[slot] = self.engine.proposer.fork() if self.engine.proposer is not None else None
        return self._proposers[slot]

    def cancel(self, seq: Sequence) -> None:
        """Take a sequence out between steps; the others are untouched. Its slot keeps what it cached (exclusive
        slots: a later request with the same prefix reuses it)."""
        if seq in self.running:
            self.running.remove(seq)
            self._free.append(seq.slot)
            if self.slots.exclusive:
                self._held[seq.slot] = seq.tokens[: self.slots.length(seq.slot)]

    def forget_held(self) -> None:
        """The slots' caches were written from outside the scheduler (the engine's calibration): what a free slot
        holds is no longer known, so no request reuses it."""
        self._held.clear()

    def fail_all(self, error: BaseException) -> list[Sequence]:
        """End every running sequence with `error` (a fault of the shared step) -> them; the scheduler stays usable."""
        return [self._end(seq, error) for seq in list(self.running)]

    # ------------------------------------------------------------------------------------------ the step
    def step(self) -> list[Sequence]:
        """Advance every running sequence by one step -> the sequences that finished (`result`) or failed (`error`).
        A background chunk (the learner's) never runs beside it (schedule/turns.py)."""
        with self.engine.turns.serving():
            return self._step()

    def _step(self) -> list[Sequence]:
        e = self.engine
        decoding = [s for s in self.running if self.slots.length(s.slot) >= s.prefill_target]
        prefilling = [s for s in self.running if self.slots.length(s.slot) < s.prefill_target]
        t0 = e.clock()
        plans, failed = self._propose(decoding, bool(prefilling))  # [(seq, proposal, source index, draft seconds)]
        feeds = [self._verify_feed(s, p) for s, p, _, _ in plans]
        contexts = [self.slots.length(s.slot) for s, _, _, _ in plans]  # what the decoding rows attend to
        decode_rows = sum(len(f.tokens) for f in feeds)
        feeds += (self._prefill_feeds(prefilling, self._prefill_budget(decode_rows, len(prefilling))) if decoding
                  else self._first_prompt_feeds(prefilling))
        t1 = e.clock()
        try:
            logits = self.slots.feed(feeds)  # one pass over the weights for every row of every sequence
        except Exception as err:  # noqa: BLE001 - the shared pass failed: every sequence in it gets the error
            self._held.clear()  # what the caches hold is no longer known for sure
            return failed + self.fail_all(err)
        t2 = e.clock()
        features = self.slots.features if self.keeps_features else [None] * len(logits)  # per feed (n_logits, H)
        rows = sum(len(f.tokens) for f in feeds)
        self._record(rows, decode_rows, t2 - t1, alone=len(self.running) == 1, plans=plans, contexts=contexts,
                     speculable=not self._quiet_beside_prompts(prefilling))
        for s in prefilling:
            s.prefill_seconds += t2 - t0
        done = failed
        for (seq, proposal, source, t_draft), target_logits, target_features in zip(plans, logits, features):
            try:
                if self._commit(seq, proposal, source, target_logits, t_draft, t2 - t1, target_features):
                    done.append(self._end(seq))
            except Exception as err:  # noqa: BLE001 - a failure of one sequence (its text callback, its stopping)
                done.append(self._end(seq, err))
        return done

    def _quiet_beside_prompts(self, prefilling) -> bool:
        """No sequence proposes in this step: it feeds prompt rows and k is adaptive (the module's docstring)."""
        return bool(prefilling) and self.engine.spec.adaptive

    def _propose(self, decoding: list[Sequence], prefilling: bool):
        plans, failed = [], []
        if len(decoding) == 1 and not prefilling and len(self.running) == 1:
            seq = decoding[0]
            try:
                plans.append(self._propose_alone(seq))
            except Exception as err:  # noqa: BLE001
                failed.append(self._end(seq, err))
            return plans, failed
        if self._quiet_beside_prompts(prefilling):  # prompt rows fill this step (the module's docstring says why)
            return [(seq, Proposal([]), None, 0.0) for seq in decoding], failed
        asked: list[tuple[Sequence, Ask]] = []
        for seq in decoding:
            try:
                asked.append((seq, self._ask_free_sources(seq)))
            except Exception as err:  # noqa: BLE001
                failed.append(self._end(seq, err))
        costs = self.engine.row_costs.at([self.slots.length(seq.slot) for seq, _ in asked])  # this step's pass
        ahead = self._draft_ahead([(seq, a) for seq, a in asked if self._drafts_ahead(seq, a, costs, len(asked))])
        asks = [a if id(seq) not in ahead else self._ask_drafted(seq, a, ahead[id(seq)]) for seq, a in asked]
        caps = [a.cap for a in asks]
        ks = caps if not self.engine.spec.adaptive else allocate_k(  # fixed k: every sequence at its cap
            [a.alpha for a in asks], [a.draft_seconds for a in asks], caps, costs, [a.catch_up_seconds for a in asks])
        ks = [self._probe(seq, k, a.source, len(asked)) for (seq, _), a, k in zip(asked, asks, ks)]
        drafted = self._draft_together([(seq, a.source, k) for (seq, a), k in zip(asked, ks)
                                        if k and a.source is not None and a.proposal is None and id(seq) not in ahead])
        for (seq, a), k in zip(asked, ks):
            try:
                plans.append(self._cut(ahead[id(seq)], k) if id(seq) in ahead else
                             drafted.get(id(seq)) or self._draft(seq, a.source, a.proposal, k))
            except Exception as err:  # noqa: BLE001
                failed.append(self._end(seq, err))
        return plans, failed

    def _drafts_ahead(self, seq: Sequence, ask: Ask, costs, decoding: int) -> bool:
        """Whether this sequence's draft proposes before the allocation (schedule/confidence.py): a draft model whose
        cache is caught up, on an adaptive engine with --confidence, where one sure token would pay for its row."""
        if ask.source is None or ask.proposal is not None or not ask.cap or \
                not self._may_draft_ahead(seq, seq.sources[ask.source]):
            return False
        return (decoding + 1) / (costs(decoding + 1) + ask.draft_seconds) > decoding / costs(decoding)

    def _may_draft_ahead(self, seq: Sequence, source) -> bool:
        """What drafting ahead needs, alone or with company: an adaptive engine with --confidence, and a draft model
        whose cache is caught up with the sequence."""
        e = self.engine
        return (e.spec.adaptive and e.spec.confidence and isinstance(source, DraftModelProposer)
                and source.lag(seq.tokens) <= CAUGHT_UP)

    def _draft_ahead(self, wanted: list[tuple[Sequence, Ask]]) -> dict:
        """Each sequence's draft proposal up to its cap, drafting on while the chance its tokens so far are all
        accepted stays >= DRAFT_AHEAD_CHANCE -> id(seq) -> plan (where drafting fails, the allocation's usual path)."""
        policies = self.engine.policies
        return self._propose_grouped([(seq, ask.source, ask.cap) for seq, ask in wanted],
                                     [self._worth_drafting(policies[ask.source].confidence) for _, ask in wanted])

    @staticmethod
    def _worth_drafting(bins):
        return lambda confidences: bins.chain(confidences)[-1] >= DRAFT_AHEAD_CHANCE

    def _ask_drafted(self, seq: Sequence, ask: Ask, plan) -> Ask:
        """The allocation's view of a proposal drafted already: each depth's chance from the draft's confidence, no
        draft seconds (spent), at most the tokens drafted."""
        proposal = plan[1]
        chain = self.engine.policies[ask.source].confidence.chain(proposal.confidence or [])
        return Ask(ask.source, None, chain, 0.0, 0.0, proposal.k)

    def _cut(self, plan, k: int):
        """A plan drafted ahead, cut to the k allocated; its draft cache keeps no more than the tokens verified."""
        seq, proposal, source, t_draft = plan
        if k < proposal.k:
            seq.sources[source].rollback(len(seq.tokens) + k)
        return seq, proposal.cut(k), source if k else None, t_draft

    def _draft_together(self, wanted: list[tuple[Sequence, int, int]]) -> dict:
        """The draft proposals of several sequences (seq, source index, k) that share a draft model -> id(seq) -> plan;
        the others (and those of a failed joint forward) draft alone (`_draft`), where a failure fails its own
        sequence only."""
        return self._propose_grouped(wanted, least=2)

    def _propose_grouped(self, wanted: list[tuple[Sequence, int, int]], go_on: list | None = None,
                         least: int = 1) -> dict:
        """Draft proposals of sequences [(seq, source index, k)], each draft model's forwards for its group in one
        (`propose_together`; go_on[i]: whether sequence i drafts on, as in `propose`) -> id(seq) -> plan, the
        forwards' seconds shared by the tokens drafted. Groups smaller than `least` are left out; where a joint
        forward fails, its sequences' draft caches are rolled back and they are left out too."""
        groups: dict[int, list[int]] = {}  # by the draft model their forwards run on
        for i, (seq, source, _) in enumerate(wanted):
            proposer = seq.sources[source]
            if isinstance(proposer, DraftModelProposer):
                groups.setdefault(id(getattr(proposer.runner, "model", proposer.runner)), []).append(i)
        plans = {}
        for members in groups.values():
            if len(members) < least:
                continue
            group = [wanted[i] for i in members]
            seqs = [seq for seq, _, _ in group]
            proposers = [seq.sources[source] for seq, source, _ in group]
            lengths = [p.runner.length for p in proposers]
            t0 = self.engine.clock()
            try:
                proposals = propose_together(proposers, [s.tokens for s in seqs], [k for _, _, k in group],
                                             [s.sampling for s in seqs], [s.generator for s in seqs],
                                             [go_on[i] for i in members] if go_on else None)
            except Exception:  # noqa: BLE001 - its sequences take their callers' usual path
                for p, length in zip(proposers, lengths):
                    p.rollback(min(length, p.runner.length))
                continue
            seconds, total = self.engine.clock() - t0, max(1, sum(p.k for p in proposals))
            for (seq, source, _), proposal in zip(group, proposals):
                plans[id(seq)] = (seq, proposal, source if proposal.k else None, seconds * proposal.k / total)
        return plans

    def _propose_alone(self, seq: Sequence):
        """One sequence alone: the first source whose policy asks for k > 0 and that finds tokens (the engine's
        single-request rule, policies and all), grown into a token tree where trees are on."""
        e = self.engine
        cap = max(0, min(e.k_max, seq.remaining - 1))
        for j, (source, policy) in enumerate(zip(seq.sources, e.policies)):
            if self._drafts_ahead_alone(seq, source, policy):
                return self._propose_ahead_alone(seq, j)
            if self._outranked(seq, j, cap):
                continue
            k = policy.choose_k(seq.remaining, catch_up_seconds(source, policy, seq.tokens))
            if k:
                t0 = e.clock()
                proposal = source.propose(seq.tokens, k, seq.sampling, seq.generator)
                if proposal.k:
                    t_draft = e.clock() - t0
                    return seq, self._grow(seq, proposal, policy.alpha, t_draft), j, t_draft
        return seq, self._grow(seq, Proposal([]), 0.0, 0.0), None, 0.0

    def _drafts_ahead_alone(self, seq: Sequence, source, policy) -> bool:
        """As `_drafts_ahead`, for a sequence decoding alone: where a sure token would pay at one-row costs."""
        return seq.remaining > 1 and self._may_draft_ahead(seq, source) and policy.could_pay()

    def _propose_ahead_alone(self, seq: Sequence, j: int):
        """Draft ahead (as `_draft_ahead`, one sequence), then verify as many of the drafted tokens as the one-row
        costs say pay."""
        e, source, policy = self.engine, seq.sources[j], self.engine.policies[j]
        cap = max(0, min(e.k_max, seq.remaining - 1))
        t0 = e.clock()
        proposal = source.propose(seq.tokens, cap, seq.sampling, seq.generator, self._worth_drafting(policy.confidence))
        t_draft = e.clock() - t0
        costs = e.target_costs.by_rows()
        chain = policy.confidence.chain(proposal.confidence or [])
        k = allocate_k([chain], [0.0], [proposal.k], lambda rows: costs[min(rows, len(costs)) - 1])[0]
        _, proposal, source_index, _ = self._cut((seq, proposal, j, t_draft), k)
        return seq, self._grow(seq, proposal, policy.alpha, t_draft), source_index, t_draft

    def _grow(self, seq: Sequence, proposal: Proposal, alpha: float, t_draft: float) -> Proposal:
        """The chain plus the draft's runners-up and the recycled table's branches (propose/tree.py), where the engine
        has trees and the measured row costs say they pay (greedy and sampled requests alike: verify/tree.py)."""
        e = self.engine
        nodes = min(e.tree_nodes, seq.remaining - 1)
        costs = e.target_costs.by_rows()
        if e.recycled is None or nodes <= proposal.k or costs is None:
            return proposal
        rates = e.runner_up_rates
        runners_up = [[(t, rates.chance(r)) for r, t in enumerate(tokens)] for tokens in proposal.runners_up or []]
        tree = grow_tree(proposal.tokens, alpha, e.recycled.candidates, seq.tokens[-1], nodes,
                         lambda rows: t_draft + costs[min(rows, len(costs)) - 1], runners_up=runners_up)
        proposal.tree = tree if tree.size > proposal.k else None
        return proposal

    def _verify_feed(self, seq: Sequence, proposal: Proposal) -> Feed:
        """The rows a sequence verifies: the tokens its cache lacks (the pending one) plus its chain or tree."""
        pending = seq.tokens[self.slots.length(seq.slot):]
        if proposal.tree is None:
            return Feed(seq.slot, pending + proposal.tokens, proposal.k + 1)
        return Feed(seq.slot, pending + proposal.tree.tokens, proposal.tree.size + 1, tree=proposal.tree.parents)

    def _ask_free_sources(self, seq: Sequence) -> Ask:
        """The first free source that finds tokens (its proposal made now), else the first source that costs draft
        forwards (and, where its cache lags, a catch-up feed first: goodput.py)."""
        e = self.engine
        cap = max(0, min(e.k_max, seq.remaining - 1))
        for j, (source, policy) in enumerate(zip(seq.sources, e.policies)):
            if cap == 0:
                break
            t_draft = policy.t_draft if policy.t_draft is not None else float("inf")
            alpha = seq.alphas[j].value(policy.alpha)
            if t_draft < FREE_SECONDS:
                if self._outranked(seq, j, cap):
                    continue
                proposal = source.propose(seq.tokens, cap, seq.sampling, seq.generator)
                if proposal.k:
                    return Ask(j, proposal, alpha, 0.0, 0.0, proposal.k)
                continue
            catch_up = amortized_catch_up(catch_up_seconds(source, policy, seq.tokens), seq.remaining, alpha)
            return Ask(j, None, alpha, t_draft, catch_up, cap)
        return Ask(None, None, 0.0, 0.0, 0.0, 0)

    def _outranked(self, seq: Sequence, j: int, cap: int) -> bool:
        """Whether free source j leaves its turn to the first draft model behind it: k is adaptive, that draft would
        speculate (its policy's k at its acceptance, one-row costs) and this sequence accepts its tokens more often than
        j's (live acceptance, each shrunk towards its source's). A lookup match from another request's answer that
        proposes worse than the draft it displaces costs a row the draft's tokens would have earned more from (chat,
        propose/ngram.py). Every PROBE_EVERY-th time it goes ahead anyway: j's acceptance moves only when it
        proposes."""
        e = self.engine
        if not e.spec.adaptive or not _costs_nothing(e.policies[j]):
            return False
        behind = next((m for m in range(j + 1, len(seq.sources)) if not _costs_nothing(e.policies[m])), None)
        if behind is None or not e.policies[behind].would_speculate(cap):
            return False
        if seq.alphas[j].value(e.policies[j].alpha) >= seq.alphas[behind].value(e.policies[behind].alpha):
            return False
        self._outranked_asks[j] += 1
        return self._outranked_asks[j] % PROBE_EVERY != 0

    def _probe(self, seq: Sequence, k: int, source: int | None, decoding: int) -> int:
        """k, or 1 where the sequence has sat at k = 0 for PROBE_EVERY steps per decoding sequence with a source to ask:
        the batch probes about once in PROBE_EVERY steps whatever the load. (Each sequence every PROBE_EVERY steps cost
        ~19% of the aggregate at 8 clients on the Q4 kernel: a probe row beside 8 decoding rows makes a second pass
        over the weights, ~25% of the step.)"""
        seq.zero_steps = 0 if k or source is None else seq.zero_steps + 1
        if seq.zero_steps >= PROBE_EVERY * max(1, decoding) and seq.remaining > 1:
            seq.zero_steps = 0
            return 1
        return k

    def _draft(self, seq: Sequence, source: int | None, proposal: Proposal | None, k: int):
        e = self.engine
        if k == 0 or source is None:
            return seq, Proposal([]), None, 0.0
        if proposal is not None:  # a free source's proposal, cut to the k allocated
            return seq, proposal.cut(k), source, 0.0
        t0 = e.clock()
        proposal = seq.sources[source].propose(seq.tokens, k, seq.sampling, seq.generator)
        return seq, proposal, source if proposal.k else None, e.clock() - t0

    def _prefill_budget(self, decode_rows: int, waiting: int) -> int:
        """Prompt rows beside decoding sequences: prefill_rows less the decode rows (at least MIN_PREFILL_ROWS) for
        each prompt waiting, up to MAX_PREFILL_ROWS: one new request barely slows the others' tokens, while a burst
        of arrivals is fed about as fast as a prefill-first server would (its last prompt's wait, TTFT p95)."""
        return min(max(self.prefill_rows - decode_rows, MIN_PREFILL_ROWS) * waiting, MAX_PREFILL_ROWS)

    def _first_prompt_feeds(self, prefilling: list[Sequence]) -> list[Feed]:
        """No sequence decodes: the oldest prompt (up to ALONE_PREFILL_ROWS rows), and the next ones in the same pass
        only while it holds fewer than prefill_rows rows, so the first request's first token does not wait for the
        prompts that arrived with it; they follow beside its decoding (a pass of many prompt rows is compute-bound:
        grouping them saves little). Two requests arriving together at 2 clients waited for one 290-row pass, 2.0 s
        to the first token each (AMD, serve-vs); now the first waits for its own 140 rows only."""
        feeds = self._prefill_feeds(prefilling[:1], ALONE_PREFILL_ROWS)
        rows = sum(len(f.tokens) for f in feeds)
        return feeds + (self._prefill_feeds(prefilling[1:], self.prefill_rows - rows) if rows < self.prefill_rows else [])

    def _prefill_feeds(self, prefilling: list[Sequence], budget: int) -> list[Feed]:
        feeds = []
        for seq in prefilling:  # in arrival order: the oldest prompt finishes first
            n = min(budget, seq.prefill_target - self.slots.length(seq.slot))
            if n <= 0:
                break
            start = self.slots.length(seq.slot)
            feeds.append(Feed(seq.slot, seq.tokens[start : start + n], 0))
            budget -= n
        return feeds

    def _commit(self, seq: Sequence, proposal: Proposal, source: int | None, target_logits, t_draft: float,
                t_target: float, target_features=None) -> bool:
        """Accept, emit, roll back the rejected tail, observe -> whether the sequence is done. target_features
        (rows, H): the LM head's input at each row, where a source reads them."""
        e, k, tree, before = self.engine, proposal.k, proposal.tree, len(seq.tokens)
        if e.recycled is not None:  # every verified row teaches the recycled table (accepted or not)
            e.recycled.observe([seq.tokens[-1]] + (tree.tokens if tree else proposal.tokens), target_logits)
        if tree is None:
            outcome, betas = verify_proposal(target_logits, proposal.tokens, proposal.draft_probs, seq.sampling,
                                             seq.generator)
            emitted = proposal.tokens[: outcome.n_accepted] + [outcome.next_token]
            rows = list(range(len(emitted)))  # token i was emitted at row i (the bonus or recovered one last)
        else:
            outcome, betas, emitted, rows = self._verify_tree(seq, proposal, target_logits)
        scored = None  # the emitted tokens' logprobs, where asked for: before a tree's logits are cut to its chain's
        if seq.logprobs is not None:
            scored = token_logprobs(target_logits[rows], emitted, seq.sampling.logprobs)
        feature = target_features[rows[-1]] if target_features is not None else None  # (H,): what chose the last
        if tree is not None:  # emitted token
            target_logits = target_logits[: k + 1]  # the chain's rows come first: the learner sees the chain's step
            target_features = target_features[: k + 1] if target_features is not None else None
        if proposal.runners_up and outcome.n_accepted < k and e.runner_up_rates is not None:  # the draft's best missed
            e.runner_up_rates.observe(proposal.runners_up[outcome.n_accepted], outcome.next_token)
        record = StepRecord(seq.request_id, seq.draft, seq.tokens[:], proposal.tokens, outcome.n_accepted,  # copied
                            outcome.next_token, target_logits, proposal.draft_probs, betas, seq.sampling.temperature,
                            t_draft, t_target, proposal.weights, target_features) if e.observers else None  # if observed
        seq.tokens += emitted
        self.slots.rollback(seq.slot, len(seq.tokens) - 1)  # keep the accepted prefix; the last token is pending
        if k:
            for s in seq.sources:
                s.rollback(before + outcome.n_accepted)  # the chain's accepted prefix: what the draft's cache holds
        if feature is not None:  # the head's next proposal starts from the target's feature before the pending token
            for s in seq.sources:
                if getattr(s, "reads_target_features", False):
                    s.observe_feature(len(seq.tokens) - 2, feature)
        if source is not None:
            e.policies[source].observe(k, outcome.n_accepted, proposal.single_token_seconds or [])
            if proposal.confidence:
                e.policies[source].confidence.observe(proposal.confidence[:k], outcome.n_accepted)
            seq.alphas[source].observe(k, outcome.n_accepted)
        seq.counters.add_step(k, outcome.n_accepted, len(emitted), betas, t_draft, t_target)
        seq.counters.rows += 1 + (tree.size if tree else k)
        if tree is not None:
            self.stats.tree_shapes[tree.shape()] += 1
            seq.counters.tree_steps += 1
            seq.counters.tree_tokens += len(emitted) - 1 - outcome.n_accepted
        seq.steps.append((k, outcome.n_accepted))
        self.stats.accepted += outcome.n_accepted
        self.stats.emitted += len(emitted)
        for observe in e.observers:
            observe(record)
        taken = len(seq.stopper.token_ids)
        seq.stopper.extend(emitted)
        if scored is not None:  # the tokens the output kept (not an EOS or stop token, nothing after the end)
            seq.logprobs += scored[: max(0, len(seq.stopper.token_ids) - taken)]
        if seq.on_text is not None and len(text := seq.stopper.stable_text()) > len(seq.sent):
            seq.on_text(text[len(seq.sent):])
            seq.sent = text
        return seq.finished

    def _verify_tree(self, seq: Sequence, proposal: Proposal, target_logits):
        """Walk down the tree (verify/tree.py: greedy, or lossless recursive rejection sampling); the cache keeps the
        accepted path only -> (the outcome of the chain part, as a chain step would report it; its betas; the
        emitted tokens; the logits row each was emitted at: the root's, then each accepted node's)."""
        tree, s = proposal.tree, seq.sampling
        if s.greedy:
            path, next_token = greedy_tree_verify(target_logits, tree)
        else:
            target_probs = warp(target_logits, s)
            path, next_token = sampled_tree_verify(target_probs, tree, proposal.draft_probs, seq.generator)
        emitted = [tree.tokens[j] for j in path] + [next_token]
        self.slots.keep_path(seq.slot, len(seq.tokens), path)
        agreed = 0  # the chain's accepted prefix: chain node d is node d
        while agreed < len(path) and agreed < tree.chain and path[agreed] == agreed:
            agreed += 1
        on_path = min(agreed + 1, tree.chain)
        betas = [1.0] * agreed + [0.0] * (agreed < tree.chain) if s.greedy else acceptance_beta(
            target_probs[:on_path], proposal.draft_probs[:on_path]).tolist() if tree.chain else []
        return VerifyOutcome(agreed, emitted[agreed]), betas, emitted, [0] + [1 + j for j in path]

    def _record(self, rows: int, decode_rows: int, seconds: float, alone: bool, plans, contexts: list[int],
                speculable: bool = True) -> None:
        e, st = self.engine, self.stats
        if alone and plans and rows == decode_rows:  # one sequence decoding: the per-rows costs the policies read
            e.target_costs.observe(rows - 1, seconds)
        elif rows and rows == decode_rows:  # decoding rows only (each with its logits: what a proposal costs); a step
            e.row_costs.observe(rows, seconds, contexts)  # with prompt rows is cheaper per row and would make proposals look cheap
        st.steps += 1
        st.rows += rows
        st.decode_rows += decode_rows
        st.prefill_rows += rows - decode_rows
        st.seconds += seconds
        if decode_rows:
            st.decode_seconds += seconds
            st.speculable_seconds += seconds if speculable else 0.0
        st.sequence_steps += len(plans)
        st.proposed += sum(p.k for _, p, _, _ in plans)
        st.last_rows, st.last_seconds = rows, seconds

    def _end(self, seq: Sequence, error: BaseException | None = None) -> Sequence:
        """The sequence leaves: its slot is freed; a finished one gets its result (and is counted in the metrics)."""
        self.cancel(seq)
        seq.error = error
        if error is None:
            self.engine.metrics.record(seq.draft, seq.counters)
            seq.result = GenerationResult(seq.request_id, seq.prompt, seq.stopper.token_ids, seq.stopper.text,
                                          seq.stopper.finish_reason, seq.draft, seq.counters,
                                          self.engine.clock() - seq.started, seq.steps, seq.prefill_seconds,
                                          seq.cached_tokens, seq.logprobs)
        return seq
