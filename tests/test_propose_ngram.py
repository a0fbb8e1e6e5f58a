"""The n-gram lookup proposer, and the k policy's refusal to speculate when drafting costs too much."""
from __future__ import annotations

import torch

from osd.config import SamplingConfig, SpeculationConfig
from osd.engine import SpeculativeEngine
from osd.propose.base import Proposal
from osd.propose.ngram import LookupThenDraft, NgramIndex, NgramProposer, TrafficIndex
from osd.speed_model import KPolicy
from tests.conftest import VOCAB, ToyTokenizer, tiny_qwen2

GREEDY = SamplingConfig(max_new_tokens=8)


def test_index_proposes_what_followed_the_longest_matching_suffix():
    index = NgramIndex(min_n=2, max_n=3)
    index.extend([5, 6, 7, 8, 9, 6, 7, 3, 4])
    assert index.lookup([1, 6, 7], k=2) == [3, 4]  # "6 7" last seen before "3 4" (the latest occurrence wins)
    assert index.lookup([5, 6, 7], k=3) == [8, 9, 6]  # "5 6 7" is longer and more specific
    assert index.lookup([2, 2], k=3) == []  # no match: no proposal
    assert index.lookup([3, 4], k=3) == []  # its continuation is not known yet


def test_traffic_index_learns_from_earlier_requests_and_forgets_the_oldest():
    traffic = TrafficIndex(min_n=2, max_n=2, span=3, capacity=4)
    traffic.add([1, 2, 3, 4, 5])
    assert traffic.lookup([9, 1, 2], k=2) == [3, 4]
    traffic.add([10, 11, 12, 13, 14])  # 4 new n-grams push the first request's out
    assert traffic.lookup([1, 2], k=2) == []
    assert traffic.lookup([11, 12], k=5) == [13, 14]


def test_proposer_uses_this_request_first_then_traffic_and_one_hot_probs_when_sampling():
    proposer = NgramProposer(vocab_size=20, min_n=2, max_n=3)
    proposer.observe_request([1, 2, 7, 7, 7])
    proposer.begin([1, 2, 3, 4])
    assert proposer.propose([1, 2, 3, 4, 1, 2], 2, GREEDY).tokens == [3, 4]  # this request's own history wins
    proposer.begin([8, 1, 2])
    assert proposer.propose([8, 1, 2], 2, GREEDY).tokens == [7, 7]  # then the traffic's
    sampled = proposer.propose([8, 1, 2], 2, SamplingConfig(temperature=1.0, max_new_tokens=8))
    assert torch.equal(sampled.draft_probs, torch.eye(20)[[7, 7]])  # (k, V) one-hot: a deterministic draft


class FixedDraft:
    name, version, runner = "fixed", 3, None

    def __init__(self):
        self.calls = 0

    def begin(self, prompt_ids):
        pass

    def propose(self, tokens, k, sampling, generator=None):
        self.calls += 1
        return Proposal([0] * k)

    def rollback(self, length):
        pass


def test_lookup_then_draft_falls_back_to_the_model_only_without_a_match():
    draft = FixedDraft()
    hybrid = LookupThenDraft(NgramProposer(20), draft)
    hybrid.begin([4, 5, 6, 4, 5])
    assert hybrid.propose([4, 5, 6, 4, 5], 2, GREEDY).tokens == [6, 4] and draft.calls == 0
    assert hybrid.propose([9, 9, 1], 2, GREEDY).tokens == [0, 0] and draft.calls == 1
    assert hybrid.version == 3 and hybrid.name == "ngram+fixed"


def test_lookup_speculation_keeps_greedy_output_identical():
    target = tiny_qwen2(0)
    tokenizer = ToyTokenizer()
    prompt = [5, 6, 7, 8, 9, 10] * 3
    plain = SpeculativeEngine(target, tokenizer, None, SpeculationConfig(k=0, adaptive=False))
    lookup = SpeculativeEngine(target, tokenizer, NgramProposer(VOCAB), SpeculationConfig(k=4, adaptive=False))
    want = plain.generate(prompt, SamplingConfig(max_new_tokens=24)).token_ids
    got = lookup.generate(prompt, SamplingConfig(max_new_tokens=24))
    assert got.token_ids == want
    assert got.counters.proposed > 0


def test_k_zero_when_the_draft_is_artificially_slow():
    """With drafting dearer than what acceptance can repay, the policy does not speculate (but probes rarely)."""
    policy = KPolicy(k_max=6, adaptive=True, alpha_prior=0.8, probe_every=16)
    policy.calibrate(t_draft=0.050, t_target=[0.030, 0.060, 0.085, 0.11, 0.13, 0.16, 0.19])  # c = 1.7
    ks = [policy.choose_k(remaining=64) for _ in range(32)]
    assert ks.count(0) == 30 and set(ks) == {0, 1}  # two probes in 32 steps
    cheap = KPolicy(k_max=6, adaptive=True, alpha_prior=0.8)
    cheap.calibrate(t_draft=0.001, t_target=[0.030, 0.031, 0.032, 0.033, 0.034, 0.035, 0.036])  # ~free verification
    assert cheap.choose_k(remaining=64) == 6
