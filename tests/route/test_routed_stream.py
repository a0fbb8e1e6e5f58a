"""The routed engine on a two-mode stream: drafts distilled on different tasks, a router that learns which
serves which mode from full-information scoring, pins, lossless output, per-draft learners."""
import random

import pytest
import torch
from conftest import EOS, ToyTokenizer, tiny_qwen2
from helpers import plain_greedy
from route_helpers import MODES, greedy_outputs, two_mode_drafts

from osd.config import SamplingConfig, SpeculationConfig
from osd.distill.evaluate import greedy_steps
from osd.engine import SpeculativeEngine
from osd.errors import DraftNotFound
from osd.learn.online import LearnConfig
from osd.route import pinned
from osd.route.config import RouteConfig
from osd.route.feedback import acceptance, score_drafts
from osd.route.system import Routing

N_OUT = 10


@pytest.fixture(scope="module")
def setup():
    target = tiny_qwen2(seed=0)
    drafts, prompts = two_mode_drafts(target, n_out=N_OUT)
    return target, drafts, prompts


def routed_engine(target, drafts, **route):
    config = RouteConfig(drafts=",".join(drafts.names()), **{"explore": 0.0, "score_share": 1.0,
                                                              "score_time_share": 1e9, **route})
    routing = Routing(drafts, config, target.config.vocab_size, ToyTokenizer())
    engine = SpeculativeEngine(target, ToyTokenizer(), routing.proposer, SpeculationConfig(k=4, adaptive=False))
    return routing.attach(engine), engine


def test_the_two_drafts_are_specialists(setup):
    """The premise: on each mode's requests its own draft accepts far more (scored teacher-forced)."""
    target, drafts, prompts = setup
    for mode, own, other in (("A", "a", "b"), ("B", "b", "a")):
        scores = {"a": [], "b": []}
        for p, out in zip(prompts[mode], greedy_outputs(target, prompts[mode], N_OUT)):
            for name, matches in score_drafts(drafts, ["a", "b"], p, out).items():
                scores[name] += matches
        assert acceptance(scores[own]) > acceptance(scores[other]) + 0.3, (mode, scores)


def test_scoring_is_exactly_the_greedy_acceptance_the_engine_sees(setup):
    """Teacher-forced agreement, cut into speculative steps (greedy_steps), accepts what the engine accepted."""
    target, drafts, prompts = setup
    routing, engine = routed_engine(target, drafts)
    for p in prompts["A"][:3] + prompts["B"][:3]:
        for name in ("a", "b"):
            with pinned(name):
                result = engine.generate(p, SamplingConfig(max_new_tokens=N_OUT))
            scored = score_drafts(drafts, [name], p, result.token_ids)[name]
            steps = greedy_steps(scored, 4, N_OUT)
            assert [(proposed, accepted) for _, accepted, proposed in steps] == result.steps
            assert sum(accepted for _, accepted, _ in steps) == result.counters.accepted


def test_router_learns_the_two_mode_stream_and_converges_to_the_right_draft(setup):
    target, drafts, prompts = setup
    routing, engine = routed_engine(target, drafts)
    rng = random.Random(0)
    served = []
    for i in range(40):
        mode = "B" if i < 3 else rng.choice("AB")  # B first: the cold start hands B to "a"; only learning fixes that
        prompt = rng.choice(prompts[mode])
        result = engine.generate(prompt, SamplingConfig(max_new_tokens=N_OUT))
        assert result.token_ids == plain_greedy(target, prompt, N_OUT, eos=EOS)[: len(result.token_ids)]  # lossless
        served.append((mode, result.draft[0]))
    right = {"A": "a", "B": "b"}
    assert all(draft == right[mode] for mode, draft in served[-15:]), served
    stats = routing.stats()
    assert stats["feedback"]["scored"] == 40 and stats["router"]["routed"] == 40
    assert stats["feedback"]["served_best"] >= 25


def test_a_pinned_draft_serves_even_against_the_router(setup):
    target, drafts, prompts = setup
    routing, engine = routed_engine(target, drafts)
    for _ in range(6):  # the router learns that "a" serves mode A
        engine.generate(prompts["A"][0], SamplingConfig(max_new_tokens=N_OUT))
    with pinned("b"):
        result = engine.generate(prompts["A"][0], SamplingConfig(max_new_tokens=N_OUT))
    assert result.draft[0] == "b" and routing.proposer.last.reason == "pinned"
    assert engine.generate(prompts["A"][0], SamplingConfig(max_new_tokens=N_OUT)).draft[0] == "a"
    with pinned("nope"), pytest.raises(DraftNotFound):
        engine.generate(prompts["A"][0], SamplingConfig(max_new_tokens=N_OUT))


def test_exploration_share_is_bounded_on_a_live_stream(setup):
    target, drafts, prompts = setup
    routing, engine = routed_engine(target, drafts, explore=0.2, score_share=0.0)
    rng = random.Random(1)
    for _ in range(25):
        engine.generate(rng.choice(prompts["A"] + prompts["B"]), SamplingConfig(max_new_tokens=4))
        router = routing.router
        assert router.explored <= 0.2 * router.routed
    assert routing.feedback.counters["scored"] == 0 and routing.router.routed == 25


def test_each_draft_learns_only_the_traffic_it_served():
    target = tiny_qwen2(seed=0)
    routing = Routing.build(tiny_qwen2(seed=1, layers=2), RouteConfig(drafts="a,b", adapter_layers=1, score_share=0.0),
                            tokenizer=ToyTokenizer())
    engine = SpeculativeEngine(target, ToyTokenizer(), routing.proposer, SpeculationConfig(k=4, adaptive=False))
    routing.attach(engine)
    learners = routing.attach_learners(LearnConfig(every_requests=2, guard=False, lr=1e-2), engine)
    before_b = routing.drafts.state("b")
    with pinned("a"):
        for p in ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15]):
            engine.generate(p, SamplingConfig(max_new_tokens=12))
    a, b = learners.learners["a"].stats(), learners.learners["b"].stats()
    assert a["requests"] == 3 and a["updates_published"] >= 1 and routing.versions()["a"] >= 1
    assert b["requests"] == 0 and b["buffer_added"] == 0 and routing.versions()["b"] == 0
    assert all(torch.equal(x, y) for x, y in zip(before_b.values(), routing.drafts.state("b").values()))
    assert learners.stats()["requests"] == 3


def test_drafts_created_and_retired_while_serving():
    target = tiny_qwen2(seed=0)
    routing = Routing.build(tiny_qwen2(seed=1, layers=2), RouteConfig(drafts="a", adapter_layers=1, score_share=1.0,
                                                                        score_time_share=1e9), tokenizer=ToyTokenizer())
    engine = SpeculativeEngine(target, ToyTokenizer(), routing.proposer, SpeculationConfig(k=4, adaptive=False))
    routing.attach(engine)
    engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=6))
    routing.create("c", copy_from="a")
    with pinned("c"):
        assert engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=6)).draft == ("c", 0)
    routing.retire("a")
    assert routing.names() == ["c"] and routing.router.names() == ["c"]
    assert engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=6)).draft[0] == "c"
    with pinned("a"), pytest.raises(DraftNotFound):
        engine.generate([5, 6, 7], SamplingConfig(max_new_tokens=6))
