"""Drafting ahead by the draft's confidence (schedule/confidence.py, scheduler._draft_ahead / _propose_ahead_alone).

The estimator is a pure class; the scheduler's use of it runs on tiny seeded models: answers stay the target's
(greedy: the same tokens; sampling: the same law), draft caches hold exactly the tokens verified after a proposal is
cut, and the bins learn only from verified tokens.
"""
from __future__ import annotations

import pytest
import torch
from test_scheduler import _Tok, draft, target  # noqa: F401 (target, draft: the scheduler tests' fixtures)

from osd.config import SamplingConfig, SpeculationConfig
from osd.drafts import DraftRegistry
from osd.engine import SpeculativeEngine
from osd.propose import DraftModelProposer
from osd.schedule.confidence import ConfidenceBins
from osd.schedule.goodput import allocate_k, goodput, tokens_of
from osd.speed_model import expected_tokens


# --- the estimator -----------------------------------------------------------------------------------------------

def test_without_evidence_a_token_is_accepted_as_often_as_the_draft_says():
    bins = ConfidenceBins()
    for p in (0.02, 0.3, 0.77, 0.99):
        assert bins.chance(p) == pytest.approx(p)


def test_evidence_moves_its_own_bin_only():
    bins = ConfidenceBins(bins=10)
    for _ in range(50):
        bins.observe([0.95], 0)  # an over-confident draft: its sure tokens rejected
    assert bins.chance(0.95) < 0.1
    assert bins.chance(0.92) < 0.1  # the same bin
    assert bins.chance(0.35) == pytest.approx(0.35)  # another bin: untouched
    for _ in range(50):
        bins.observe([0.35], 1)  # an under-confident one
    assert bins.chance(0.35) > 0.9


def test_only_tokens_up_to_the_first_rejection_teach():
    bins = ConfidenceBins(bins=10)
    bins.observe([0.95, 0.95, 0.15, 0.55], 1)  # first accepted, second rejected, the rest never judged
    table = {row["bin"]: row for row in bins.table()}
    assert list(table) == ["[0.90, 1.00)"]
    assert table["[0.90, 1.00)"]["seen"] == 2 and table["[0.90, 1.00)"]["acceptance"] == pytest.approx(0.5, abs=0.01)
    bins.observe([0.55, 0.55], 2)  # all accepted: no rejection to count
    assert {row["bin"]: row["acceptance"] for row in bins.table()}["[0.50, 0.60)"] == 1.0


def test_the_window_forgets_an_old_calibration():
    """A new draft version calibrates differently: old evidence fades (window ~200 tokens a bin)."""
    bins = ConfidenceBins(bins=10, window=50)
    for _ in range(500):
        bins.observe([0.85], 0)
    assert bins.chance(0.85) < 0.05
    for _ in range(250):
        bins.observe([0.85], 1)
    assert bins.chance(0.85) > 0.95


def test_a_chain_is_the_running_product_of_the_chances():
    bins = ConfidenceBins()
    assert bins.chain([0.9, 0.5, 0.8]) == pytest.approx([0.9, 0.45, 0.36])
    assert bins.chain([]) == []


# --- the allocation over drafted chains --------------------------------------------------------------------------

def q4_like(rows: int) -> float:
    return 1.0 + 0.1 * (min(rows, 8) - 1) + 0.2 * max(0, rows - 8)


def test_a_drafted_chain_counts_the_tokens_its_chances_promise():
    assert tokens_of([0.9, 0.45], 0) == 1.0
    assert tokens_of([0.9, 0.45], 2) == pytest.approx(2.35)
    assert tokens_of(0.6, 3) == pytest.approx(expected_tokens(0.6, 3))  # an acceptance: the geometric form


def test_the_allocation_verifies_sure_tokens_and_leaves_out_unsure_ones_at_the_same_average():
    """Two sequences whose drafts accept half their tokens on average: one sure of its first two tokens, the other
    unsure of its. From the average alone both get the same k; from the chains only the sure one's rows are bought."""
    sure, unsure = [0.97, 0.94, 0.2], [0.15, 0.02, 0.0]
    rows_cost = lambda rows: 1.0 + 0.25 * (rows - 1)  # a busier machine: a row is a quarter of a pass
    by_average = allocate_k([0.5, 0.5], [0.0, 0.0], [3, 3], rows_cost)
    assert by_average[0] == by_average[1]
    ks = allocate_k([sure, unsure], [0.0, 0.0], [3, 3], rows_cost)
    assert ks == [2, 0]
    assert goodput([sure, unsure], ks, [0.0, 0.0], rows_cost) > goodput([sure, unsure], by_average, [0.0, 0.0], rows_cost)


# --- the draft's proposal stops where asked -----------------------------------------------------------------------

def proposer_of(draft, prompt):
    registry = DraftRegistry()
    registry.publish("draft", draft)
    proposer = DraftModelProposer(registry, "draft", draft.config.vocab_size)
    proposer.begin(prompt)
    return proposer


@torch.inference_mode()
def test_a_proposal_names_its_confidence_and_go_on_stops_it(draft):
    prompt = [5, 6, 7, 8]
    greedy = SamplingConfig(max_new_tokens=16)
    full = proposer_of(draft, prompt).propose(prompt, 5, greedy)
    logits = draft(torch.tensor([prompt + full.tokens])).logits[0, len(prompt) - 1: -1]  # each proposal's position
    assert full.confidence == pytest.approx(logits.softmax(-1).max(-1).values.tolist(), rel=1e-4)
    short = proposer_of(draft, prompt).propose(prompt, 5, greedy, go_on=lambda confidences: len(confidences) < 2)
    assert short.tokens == full.tokens[:2] and short.confidence == pytest.approx(full.confidence[:2])
    cut = full.cut(1)
    assert cut.tokens == full.tokens[:1] and cut.confidence == full.confidence[:1] and full.cut(0).k == 0


# --- the scheduler ------------------------------------------------------------------------------------------------

class _Rows:
    """Row costs where a row costs `row` of a one-row pass: proposals pay where their chance is high enough."""

    def __init__(self, row: float):
        self.row = row

    def observe(self, rows, seconds, contexts):
        pass

    def at(self, contexts):
        return self

    def __call__(self, rows):
        return 1.0 + self.row * (rows - 1)


def confident_engine(target, draft, confidence=True, max_batch=4, row=0.1):
    registry = DraftRegistry()
    registry.publish("draft", draft)
    spec = SpeculationConfig(k=5, adaptive=True, max_batch=max_batch, confidence=confidence)
    engine = SpeculativeEngine(target, _Tok(), DraftModelProposer(registry, "draft", target.config.vocab_size), spec)
    engine.row_costs = _Rows(row)
    for policy in engine.policies:  # a cheap draft on a machine where a row costs `row` of a pass
        policy.calibrate(1e-3, [1.0 + row * k for k in range(engine.k_max + 1)])
    return engine


PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [20], [3, 4, 3, 4, 3, 4, 3], [30, 31, 32, 33] * 3, [8, 9]]


@pytest.mark.parametrize("row", [0.1, 0.9])
def test_drafting_ahead_keeps_every_greedy_answer_and_each_draft_cache_holds_what_was_verified(target, draft, row):
    """Confidence on: each step drafts before the allocation and cuts the proposals it does not verify (rows at 0.9
    of a pass: almost every proposal cut to nothing). Every answer is the target-only one, and after every step each
    running sequence's draft cache holds a prefix of its tokens (a cut that left drafted tokens in the cache would
    make later proposals come from a context that never was)."""
    from osd.schedule import scheduler as scheduler_module

    target_only = SpeculativeEngine(target, _Tok(), None, SpeculationConfig(k=0, adaptive=False))
    want = [target_only.generate(p, SamplingConfig(max_new_tokens=14)).token_ids for p in PROMPTS]
    engine = confident_engine(target, draft, row=row)
    if row > 0.5:  # a draft whose tokens are accepted 8 times in 10 whatever it says: it drafts deep, rows too dear
        bins = engine.policies[0].confidence
        bins.accepted, bins.seen = [80.0] * bins.bins, [100.0] * bins.bins
    cuts = []
    real_cut = scheduler_module.Scheduler._cut
    engine.scheduler._cut = lambda plan, k: cuts.append((plan[1].k, k)) or real_cut(engine.scheduler, plan, k)
    sched, got, by_seq, pending = engine.scheduler, {}, {}, list(enumerate(PROMPTS))
    while pending or sched.running:
        if pending and len(sched.running) < sched.capacity:
            i, prompt = pending.pop(0)
            by_seq[id(sched.add(prompt, SamplingConfig(max_new_tokens=14)))] = i
        for seq in sched.step():
            assert seq.error is None, seq.error
            got[by_seq[id(seq)]] = seq.result.token_ids
        for seq in sched.running:
            for source in seq.sources:
                assert source.held == seq.tokens[: len(source.held)] and len(source.held) == source.runner.length
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert any(k < drafted for drafted, k in cuts)
    if row == 0.1:
        assert any(k > 0 for _, k in cuts)  # cut, and verified
    else:
        assert any(k == 0 and drafted >= 2 for drafted, k in cuts)  # drafted tokens the cache must drop
    alone = [engine.generate(p, SamplingConfig(max_new_tokens=14)).token_ids for p in PROMPTS]
    assert alone == want
    assert sum(row["seen"] for row in engine.policies[0].confidence.table()) > 0  # the bins learnt


def test_without_confidence_nothing_drafts_ahead_and_the_bins_still_learn(target, draft):
    """--no-confidence: k from the average acceptance (nothing drafted before the allocation, alone or with company);
    the bins still learn from what is verified, so /metrics shows the draft's calibration either way."""
    engine = confident_engine(target, draft, confidence=False)
    engine.scheduler._draft_ahead = lambda wanted: pytest.fail("drafted ahead with --no-confidence") if wanted else {}
    engine.scheduler._propose_ahead_alone = lambda seq, j: pytest.fail("drafted ahead alone with --no-confidence")
    for p in PROMPTS[:3]:
        engine.generate(p, SamplingConfig(max_new_tokens=10))
    run_together = [engine.scheduler.add(p, SamplingConfig(max_new_tokens=10)) for p in PROMPTS[3:]]
    while engine.scheduler.running:
        engine.scheduler.step()
    assert all(seq.error is None for seq in run_together)
    assert sum(row["seen"] for row in engine.policies[0].confidence.table()) > 0


def test_metrics_show_each_sources_acceptance_by_confidence():
    from types import SimpleNamespace

    from osd.serve.prom import confidence_families

    bins = ConfidenceBins(bins=10)
    bins.observe([0.95, 0.93, 0.42], 2)  # two sure tokens accepted, an unsure one rejected
    engine = SimpleNamespace(sources=[SimpleNamespace(name="draft")], policies=[SimpleNamespace(confidence=bins)])
    acceptance, seen = confidence_families(engine)
    got = {tuple(s.labels.values()): s.value for s in acceptance.samples}
    assert got == {("draft", "[0.90, 1.00)"): 1.0, ("draft", "[0.40, 0.50)"): 0.0}
    assert {tuple(s.labels.values()): s.value for s in seen.samples}[("draft", "[0.90, 1.00)")] == 2.0
