"""The n-gram lookup proposer, and the k policy's refusal to speculate when drafting costs too much."""
from __future__ import annotations

import pytest
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

    def begin(self, prompt_ids, prefill=True):
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


def test_k_zero_when_the_draft_is_artificially_slow_and_probes_back_off():
    """With drafting dearer than what acceptance can repay, the policy does not speculate; its probes (k = 2,
    each of which makes a model draft catch up on the whole context) come ever more rarely."""
    policy = KPolicy(k_max=6, adaptive=True, alpha_prior=0.3, probe_every=16, max_probe_every=512)
    policy.calibrate(t_draft=0.005, t_target=[0.030, 0.040, 0.050, 0.060, 0.070, 0.080, 0.090])  # pays only if alpha is high
    ks = [policy.choose_k(remaining=64) for _ in range(1000)]
    assert [i for i, k in enumerate(ks) if k] == [15, 47, 111, 239, 495]  # intervals 16, 32, 64, 128, 256 (then 512)
    assert [k for k in ks if k] == [2, 1, 2, 1, 2]  # every second probe re-times 2-row verification
    cheap = KPolicy(k_max=6, adaptive=True, alpha_prior=0.8)
    cheap.calibrate(t_draft=0.001, t_target=[0.030, 0.031, 0.032, 0.033, 0.034, 0.035, 0.036])  # ~free verification
    assert cheap.choose_k(remaining=64) == 6


def test_only_rare_probes_where_even_a_perfect_draft_would_not_pay():
    policy = KPolicy(k_max=3, adaptive=True, alpha_prior=0.8, probe_every=4, max_probe_every=512)
    policy.calibrate(t_draft=0.024, t_target=[0.030, 0.052, 0.080, 0.086])  # c = 0.8, 2 rows = 1.72x (measured)
    ks = [policy.choose_k(64) for _ in range(1100)]
    assert [i for i, k in enumerate(ks) if k] == [511, 1023] and ks[511] == 2  # every max_probe_every steps only


def test_a_draft_cost_measured_cold_does_not_switch_speculation_off_for_good():
    """A first request on cold caches times the draft 100x too slow: speculation stops, the next probe re-times
    the draft (its second, single-token forward) and speculation resumes."""
    policy = KPolicy(k_max=4, adaptive=True, alpha_prior=0.8, probe_every=4, max_probe_every=64)
    policy.calibrate(t_draft=0.001, t_target=[0.030, 0.031, 0.032, 0.033, 0.034])  # ~free verification
    assert policy.choose_k(64) == 4
    policy.observe(4, 4, [0.1, 0.1, 0.1, 0.1])  # cold: the estimate is now far above the true cost
    ks = [policy.choose_k(64) for _ in range(64)]
    assert ks[:63] == [0] * 63 and ks[63] == 2  # no speculation, then one probe
    policy.observe(2, 2, [0.001])  # the probe's timed forward, warm
    assert policy.t_draft == 0.001 and policy.choose_k(64) == 4
    policy.observe(4, 4, [0.002])  # a slower timing moves the estimate through the EMA only
    assert abs(policy.t_draft - 0.0012) < 1e-12


def test_probe_interval_resets_once_speculation_pays_again():
    policy = KPolicy(k_max=4, adaptive=True, alpha_prior=0.3, probe_every=4)
    policy.calibrate(t_draft=0.001, t_target=[0.030, 0.054, 0.075, 0.09, 0.10])
    assert [policy.choose_k(64) for _ in range(12)] == [0, 0, 0, 2] + [0] * 7 + [1]  # backed off to 8
    for _ in range(20):  # the draft turned out right every time
        policy.observe(4, 4, [0.001])
    assert policy.choose_k(64) == 4
    policy.accepted, policy.rejected = 3.0, 7.0  # and wrong again
    assert [policy.choose_k(64) for _ in range(4)] == [0, 0, 0, 2]  # back to the base interval


class SlowRightDraft:
    """Proposes the target's own greedy tokens (always accepted) but reports 5 s per draft forward."""

    name, version, runner = "slow", 0, None

    def __init__(self, want):
        self.want, self.calls = want, 0

    def begin(self, prompt_ids, prefill=True):
        self.prompt_len = len(prompt_ids)

    def propose(self, tokens, k, sampling, generator=None):
        self.calls += 1
        done = len(tokens) - self.prompt_len
        return Proposal(self.want[done:done + k], single_token_seconds=[5.0] * k)

    def rollback(self, length):
        pass


class TickClock:
    """Each reading is 30 ms after the previous one: every target feed "takes" 30 ms whatever its rows."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.030
        return self.now


def _engine_with_costs(target, draft, t_draft):
    engine = SpeculativeEngine(target, ToyTokenizer(), draft, SpeculationConfig(k=4, adaptive=True), clock=TickClock())
    engine.target_costs.calibrate([0.030, 0.054, 0.075, 0.09, 0.10])
    for policy, t in zip(engine.policies, t_draft):
        policy.calibrate(t)
    return engine


def test_engine_stops_speculating_with_a_slow_draft_and_keeps_a_free_lookup():
    target = tiny_qwen2(0)
    prompt = [5, 6, 7, 8, 9, 10] * 3
    sampling = SamplingConfig(max_new_tokens=48)
    want = SpeculativeEngine(target, ToyTokenizer(), None, SpeculationConfig(k=0)).generate(prompt, sampling).token_ids
    slow = _engine_with_costs(target, SlowRightDraft(want), [5.0])
    result = slow.generate(prompt, sampling)
    assert result.token_ids == want
    ks = [k for k, _ in result.steps]
    assert sum(k > 0 for k in ks) <= 2 and ks.count(0) >= 40  # at most the probes speculated
    # a free lookup in front of the same slow draft: the lookup keeps speculating, the model draft stays idle
    draft = SlowRightDraft(want)
    chained = _engine_with_costs(target, LookupThenDraft(NgramProposer(VOCAB), draft), [0.0, 5.0])
    result = chained.generate(prompt, sampling)
    assert result.token_ids == want
    assert result.counters.proposed > 0 and draft.calls <= 2


def test_a_new_draft_version_is_probed_at_once():
    policy = KPolicy(k_max=4, adaptive=True, alpha_prior=0.3, probe_every=4, max_probe_every=64)
    policy.calibrate(t_draft=0.001, t_target=[0.030, 0.054, 0.075, 0.09, 0.10])  # alpha 0.3: k = 0, probes back off
    policy.on_draft_version(0)
    ks = [policy.choose_k(64) for _ in range(60)]
    assert [i for i, k in enumerate(ks) if k] == [3, 11, 27, 59]  # intervals 4, 8, 16, 32
    assert [policy.choose_k(64) for _ in range(5)] == [0] * 5  # now 64 steps apart
    policy.on_draft_version(0)  # the same version: nothing changes
    assert policy.choose_k(64) == 0
    policy.on_draft_version(1)  # the learner published a new draft: probe it at once, then back off from the base
    assert [policy.choose_k(64) for _ in range(10)] == [2] + [0] * 7 + [1, 0]  # interval 8 (not 128) after it


def test_the_engine_tells_each_policy_the_draft_version(target_model, tokenizer):
    from helpers import make_engine
    engine, registry = make_engine(target_model, tiny_qwen2(seed=3, layers=1), tokenizer, k=3, adaptive=True)
    seen = []
    engine.policies[0].on_draft_version = seen.append
    engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=4))
    registry.publish("draft", tiny_qwen2(seed=4, layers=1))
    engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=4))
    assert seen == [0, 1]


def _declining_policy(alpha_prior: float) -> KPolicy:
    """k = 0 at the prior; the draft (1/6 of a target token) would pay if every proposal were accepted."""
    policy = KPolicy(k_max=4, adaptive=True, alpha_prior=alpha_prior, probe_every=8, max_probe_every=512)
    policy.calibrate(t_draft=0.005, t_target=[0.030, 0.033, 0.036, 0.04, 0.044])
    return policy


def test_a_probe_whose_catch_up_is_dear_waits_until_it_is_a_small_share_of_the_time():
    """alpha 0.05, outside the noise band: a probe that must first feed 0.3 s of missed tokens waits until the k = 0
    steps since the last probe cost 0.3 / 0.02 s (500 steps of 30 ms), not the base 8."""
    free = _declining_policy(0.05)
    assert [i for i, k in enumerate(free.choose_k(64) for _ in range(8)) if k] == [7]
    dear = _declining_policy(0.05)
    assert [i for i, k in enumerate(dear.choose_k(64, catch_up_seconds=0.3) for _ in range(600)) if k] == [499]


def test_near_break_even_or_for_a_new_version_a_dear_catch_up_does_not_delay_the_probe():
    near = _declining_policy(0.25)  # k = 0 at 0.25, k = 1 pays at the upper bound: the draft may pay
    assert near._best(4) == 0 and near._best(4, alpha=near.alpha_upper) > 0
    assert [i for i, k in enumerate(near.choose_k(64, catch_up_seconds=0.3) for _ in range(8)) if k] == [7]
    fresh = _declining_policy(0.05)
    fresh.on_draft_version(0)
    fresh.on_draft_version(1)  # the learner published: probed at the next k = 0 step, catch-up or not
    assert fresh.choose_k(64, catch_up_seconds=0.3) > 0
    assert [i for i, k in enumerate(fresh.choose_k(64, catch_up_seconds=0.3) for _ in range(600)) if k] == [499]


def test_the_engine_gives_the_policy_the_catch_up_of_the_draft_it_would_ask():
    target = tiny_qwen2(0)
    prompt = [5, 6, 7, 8, 9, 10] * 3
    want = SpeculativeEngine(target, ToyTokenizer(), None, SpeculationConfig(k=0)).generate(prompt, GREEDY).token_ids
    draft = SlowRightDraft(want)
    draft.lag = lambda tokens: len(tokens) - 1  # it never fed a token: it lags by all of them
    engine = _engine_with_costs(target, draft, [5.0])
    engine.policies[0].t_catch_up = 0.002
    seen, choose = [], engine.policies[0].choose_k
    engine.policies[0].choose_k = lambda remaining, catch_up_seconds=0.0: seen.append(catch_up_seconds) or choose(
        remaining, catch_up_seconds)
    engine.generate(prompt, GREEDY)
    assert seen and seen[0] == pytest.approx(0.002 * (len(prompt) - 1))
    assert seen == sorted(seen)  # the lag grows with every token committed without the draft


def test_traffic_lookup_proposes_from_earlier_requests_only_and_its_forks_share_the_index():
    from osd.propose.ngram import TrafficLookup
    traffic = TrafficLookup(vocab_size=20, min_n=2, max_n=2)
    twin = traffic.fork()
    assert traffic.propose([3, 4, 3, 4], 2, GREEDY).tokens == []  # the request's own repeat is not its business
    twin.observe_request([1, 2, 7, 8, 9])  # one sequence's finished request teaches the others
    assert traffic.propose([5, 1, 2], 3, GREEDY).tokens == [7, 8, 9]
    sampled = traffic.propose([5, 1, 2], 2, SamplingConfig(temperature=1.0, max_new_tokens=8))
    assert torch.equal(sampled.draft_probs, torch.eye(20)[[7, 8]])
    chained = LookupThenDraft(NgramProposer(20, traffic=False), FixedDraft(), traffic)
    assert chained.name == "ngram+traffic+fixed" and chained.sources[1] is traffic
    chained.begin([5, 1, 2, 9, 1, 2])
    assert chained.propose([5, 1, 2, 9, 1, 2], 2, GREEDY).tokens == [9, 1]  # the request's own match first


class Scripted:
    """Proposes the target's greedy continuation (`wants`, by prompt), right for its first `right` tokens of a
    proposal and wrong after; `seconds` per draft token (None: a free source). Forks share the wants and the calls."""

    runner, version = None, 0

    def __init__(self, name, wants, right, seconds, calls=None):
        self.name, self.wants, self.right, self.seconds = name, wants, right, seconds
        self.calls = calls if calls is not None else [0]

    def fork(self):
        return Scripted(self.name, self.wants, self.right, self.seconds, self.calls)

    def begin(self, prompt_ids, prefill=True):
        self.prompt = tuple(prompt_ids)

    def propose(self, tokens, k, sampling, generator=None):
        self.calls[0] += 1
        want = self.wants[self.prompt]
        out = want[len(tokens) - len(self.prompt):][:k]
        out = out[: self.right] + [(t + 1) % VOCAB for t in out[self.right:]]
        return Proposal(out, single_token_seconds=[self.seconds] * len(out) if self.seconds else None)

    def rollback(self, length):
        pass


@pytest.mark.parametrize("together", [False, True])
def test_a_free_lookup_leaves_its_turn_to_a_draft_that_is_accepted_more_often(together):
    """A free source right on 1 token of each proposal (acceptance ~0.5, which pays at zero cost) before a draft right
    on all of them: the draft proposes, and the lookup is asked again only as a probe, alone and beside another
    sequence; the answers stay the target's. Without the rule (`_outranked` never true) the lookup takes every turn."""
    from osd.propose.chain import Sources
    target = tiny_qwen2(0)
    prompts = [[5, 6, 7, 8, 9, 10] * 3, [11, 3, 9, 4, 12, 2]]
    sampling = SamplingConfig(max_new_tokens=64)
    plain = SpeculativeEngine(target, ToyTokenizer(), None, SpeculationConfig(k=0))
    wants = {tuple(p): plain.generate(p, sampling).token_ids for p in prompts}

    def run(rule: bool):
        lookup, draft = Scripted("lookup", wants, 1, None), Scripted("draft", wants, 99, 0.001)
        engine = SpeculativeEngine(target, ToyTokenizer(), Sources([lookup, draft]),
                                   SpeculationConfig(k=4, adaptive=True, max_batch=2), clock=TickClock())
        engine.target_costs.calibrate([0.030, 0.031, 0.032, 0.033, 0.034])  # verification ~free: any k > 0 pays
        engine.row_costs.calibrate({n: 0.030 + 0.001 * n for n in range(1, 16)})
        for policy, t in zip(engine.policies, [0.0, 0.001]):
            policy.calibrate(t)
        if not rule:
            engine.scheduler._outranked = lambda *args: False
        if together:
            sched = engine.scheduler
            seqs = [sched.add(p, sampling) for p in prompts]
            while sched.running:
                sched.step()
            results = [s.result for s in seqs]
        else:
            results = [engine.generate(p, sampling) for p in prompts]
        assert [r.token_ids for r in results] == [wants[tuple(p)] for p in prompts]
        return lookup.calls[0], draft.calls[0], sum(len(r.steps) for r in results)

    asked, drafted, steps = run(rule=True)
    assert drafted >= steps // 2 and asked <= 4 + steps // 8  # the first asks, then a probe in PROBE_EVERY asks
    asked_before, drafted_before, steps_before = run(rule=False)
    assert asked_before >= steps_before - 2 and drafted_before <= 2 and steps < steps_before


def test_a_traffic_lookup_that_does_not_learn_keeps_its_index_empty():
    from osd.propose.ngram import TrafficLookup
    still = TrafficLookup(vocab_size=20, min_n=2, max_n=2, learns=False)
    still.fork().observe_request([1, 2, 7, 8, 9])
    assert not still.index.table and still.propose([5, 1, 2], 3, GREEDY).tokens == []
