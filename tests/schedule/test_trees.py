"""Token trees end to end on the tiny Q4 GGUF: greedy output identical to target-only with trees of recycled
branches (alone and with a draft and the lookup), the recycled table filled from verification rows only, the learner
seeing the chain's step; plus the pure parts: the tree shape policy and the greedy walk."""
from __future__ import annotations

import itertools

import pytest
from conftest import require_module, require_q4
import torch

require_module("llama_cpp")

from osd.config import SamplingConfig, SpeculationConfig  # noqa: E402
from osd.drafts import DraftRegistry  # noqa: E402
from osd.engine import SpeculativeEngine  # noqa: E402
from osd.models.q4_runner import Q4Runner  # noqa: E402
from osd.propose.draft_model import DraftModelProposer  # noqa: E402
from osd.propose.ngram import LookupThenDraft, NgramProposer  # noqa: E402
from osd.propose.recycle import RecycledTable  # noqa: E402
from osd.propose.tree import Tree, grow_tree  # noqa: E402
from osd.verify.tree import greedy_tree_verify  # noqa: E402
from tests.models.tiny_gguf import PROMPT, VOCAB, ByteTokenizer, target_only, tiny, tiny_torch_model  # noqa: E402,F401

require_q4()
N = 40


@pytest.fixture(scope="module")
def runner(tiny):
    return Q4Runner(tiny[0], n_ctx=256)


def flat_costs(engine, rows: int = 9) -> None:
    """Row costs that make every node worth its row (deterministic tests; real ones are measured)."""
    engine.target_costs.calibrate([1.0] * rows)


def engine_with(runner, proposer=None, tree=8, **spec):
    """An engine whose clock ticks once per reading: every pass 'costs' the same, whatever its rows (the tiny
    model's real timings are noise), so the tree policy's choices do not depend on the machine."""
    ticks = itertools.count()
    engine = SpeculativeEngine(runner, ByteTokenizer(), proposer, SpeculationConfig(tree=tree, **spec),
                               clock=lambda: float(next(ticks)))
    flat_costs(engine)
    for policy in engine.policies:
        policy.calibrate(0.001)
    return engine


@pytest.mark.parametrize("prompt_shift", [0, 3])
def test_trees_of_recycled_tokens_give_target_only_output(runner, prompt_shift):
    prompt = PROMPT[prompt_shift:]
    want = target_only(runner, prompt, N)
    engine = engine_with(runner)
    results = [engine.generate(prompt, SamplingConfig(max_new_tokens=N)) for _ in range(3)]  # the table warms up
    assert all(r.token_ids == want for r in results)
    last = results[-1].counters
    assert last.tree_steps > 0 and last.tree_tokens > 0  # recycled branches were verified and accepted
    assert last.steps < N  # so fewer target passes than tokens
    assert last.rows > last.steps  # trees of several rows


@pytest.mark.parametrize("draft_seed", [0, 7])  # 0: the target's twin (long chains), 7: a stranger (rejections)
def test_trees_beside_a_draft_and_the_lookup_give_target_only_output(tiny, runner, draft_seed):
    registry = DraftRegistry()
    registry.publish("d", tiny[1] if draft_seed == 0 else tiny_torch_model(draft_seed))
    proposer = LookupThenDraft(NgramProposer(VOCAB), DraftModelProposer(registry, "d", VOCAB))
    want = target_only(runner, PROMPT, N)
    for k in (1, 3, 6):
        engine = engine_with(runner, proposer, k=k, adaptive=False)
        result = engine.generate(PROMPT, SamplingConfig(max_new_tokens=N))
        assert result.token_ids == want, k
        assert result.counters.tree_steps > 0 or k >= 8


def test_sampled_requests_verify_trees_reproducibly(tiny, runner):
    """Sampled requests verify trees too (lossless: tests/verify/test_tree_sampling.py); with a seed, two engines in the
    same state give the same answer (the recycled table is part of that state: it shapes the trees)."""
    registry = DraftRegistry()
    registry.publish("d", tiny_torch_model(7))
    sampling = SamplingConfig(max_new_tokens=N, temperature=0.8, top_p=0.95, seed=1)
    answers = []
    for _ in range(2):
        engine = engine_with(runner, DraftModelProposer(registry, "d", VOCAB), k=2, adaptive=False)
        engine.generate(PROMPT, SamplingConfig(max_new_tokens=N))  # warm the table
        answers.append(engine.generate(PROMPT, sampling))
    first = answers[0]
    assert first.counters.tree_steps > 0 and first.counters.rows > first.counters.steps + first.counters.proposed
    assert first.token_ids == answers[1].token_ids
    assert len(first.token_ids) == N and all(0 <= t < VOCAB for t in first.token_ids)


def test_the_recycled_table_learns_from_verification_rows_only(runner):
    engine = engine_with(runner)
    table = engine.recycled
    assert table.rows == 0 and int((table.next >= 0).sum()) == 0
    result = engine.generate(PROMPT, SamplingConfig(max_new_tokens=N))
    assert table.rows == result.counters.rows  # one entry update per verified row, none from the prompt's rows
    verified = set(result.token_ids[:-1]) | {PROMPT[-1]}
    filled = set((table.next[:, 0] >= 0).nonzero()[:, 0].tolist())
    assert PROMPT[-1] in filled and filled >= set(result.token_ids[:-1]) - {result.token_ids[-1]}
    prompt_only = set(PROMPT[:-1]) - verified - filled
    for token in prompt_only:  # a token fed only as a prompt row never enters the table
        assert table.candidates(token) == []
    assert table.asks > 0 and 0 < sum(table.hits) <= table.asks


def test_the_learner_sees_the_chain_part_of_a_tree_step(tiny, runner):
    registry = DraftRegistry()
    registry.publish("d", tiny_torch_model(7))
    engine = engine_with(runner, DraftModelProposer(registry, "d", VOCAB), k=2, adaptive=False)
    records = []
    engine.observers.append(records.append)
    result = engine.generate(PROMPT, SamplingConfig(max_new_tokens=N))
    assert result.counters.tree_steps > 0
    for r in records:
        assert r.target_logits.shape[0] == len(r.proposed) + 1
        assert r.next_token == int(r.target_logits[r.n_accepted].argmax())  # what a chain step would report


# ------------------------------------------------------------------------------------------ the pure parts
def test_greedy_walk_follows_the_targets_argmax_down_the_tree():
    tree = Tree([5, 6, 7, 8], [-1, -1, 1, 1])  # root -> 5, 6; 6 -> 7, 8
    logits = torch.zeros(5, 10)
    logits[0, 6] = 1  # root: target says 6 (node 1)
    logits[2, 8] = 1  # at node 1: target says 8 (node 3)
    logits[4, 2] = 1  # at node 3: target says 2, not in the tree
    assert greedy_tree_verify(logits, tree) == ([1, 3], 2)
    logits[0] = 0
    logits[0, 9] = 1
    assert greedy_tree_verify(logits, tree) == ([], 9)


def test_grow_tree_keeps_the_chain_adds_best_first_and_cuts_where_rows_stop_paying():
    table = {1: [(10, 0.5), (11, 0.2)], 10: [(12, 0.5)], 2: [(20, 0.5)], 3: [(30, 0.9)]}
    candidates = lambda t: table.get(t, [])  # noqa: E731
    flat = grow_tree([2, 3], 0.5, candidates, root_token=1, max_nodes=8, step_seconds=lambda rows: 1.0)
    assert flat.tokens[:2] == [2, 3] and flat.parents[:2] == [-1, 0] and flat.chain == 2
    assert set(zip(flat.parents, flat.tokens)) >= {(-1, 10), (-1, 11), (1, 30)}  # recycled under root and chain
    assert flat.scores[2:] == sorted(flat.scores[2:], reverse=True)  # best first
    assert len(set(zip(flat.parents, flat.tokens))) == flat.size  # no sibling twice
    steep = grow_tree([2, 3], 0.5, candidates, root_token=1, max_nodes=8, step_seconds=lambda rows: float(rows))
    assert steep.tokens == [2, 3]  # a row costs as much as a token: nothing added
    capped = grow_tree([], 0.0, candidates, root_token=1, max_nodes=2, step_seconds=lambda rows: 1.0)
    assert capped.tokens == [10, 12] and capped.parents == [-1, 0]  # 0.5 then 0.25 beat 0.2


def test_recycled_table_ranks_and_counts():
    table = RecycledTable(vocab_size=8, width=2)
    logits = torch.tensor([[0, 0, 3, 2, 0, 0, 0, 0], [0, 5, 0, 0, 4, 0, 0, 0.]])
    table.observe([1, 1], logits)  # token 1 twice: the latest row wins
    assert [t for t, _ in table.candidates(1)] == [1, 4]
    table.observe([1], torch.tensor([[0, 0, 0, 0, 9, 0, 0, 1.]]))  # target's argmax 4 was the rank-1 entry
    assert table.asks == 1 and table.hits == [0, 1]
    assert table.candidates(5) == []


def test_rank_rates_count_the_rank_that_held_the_targets_token():
    """The draft's runners-up are weighed by how often rank r held the target's token where the draft's best missed
    (smoothed by a prior worth PRIOR_WEIGHT asks): the rank that held it is counted, a miss of all only asked."""
    from osd.propose.recycle import PRIOR_WEIGHT, RankRates

    rates = RankRates((0.3, 0.1, 0.05), width=3)
    rates.observe([5, 7, 9], 7)
    rates.observe([5, 7, 9], 9)
    rates.observe([5, 7, 9], 4)
    rates.observe([5, 7], 7)
    assert rates.asks == 4 and rates.hits == [0, 2, 1]
    assert rates.chance(1) == pytest.approx((2 + PRIOR_WEIGHT * 0.1) / (4 + PRIOR_WEIGHT))
    assert rates.chance(0) == pytest.approx(PRIOR_WEIGHT * 0.3 / (4 + PRIOR_WEIGHT))
    assert rates.stats()["hit_rate_by_rank"] == [0.0, 0.5, 0.25]


def test_the_drafts_runners_up_hang_beside_its_chain(tiny, runner):
    flat = grow_tree([2, 3], 0.5, lambda t: [], root_token=1, max_nodes=8, step_seconds=lambda rows: 1.0,
                     runners_up=[[(7, 0.4)], [(8, 0.4), (3, 0.9)]])
    assert (-1, 7) in zip(flat.parents, flat.tokens)  # beside chain[0]: under the root
    assert (0, 8) in zip(flat.parents, flat.tokens)  # beside chain[1]: under chain[0]
    assert flat.scores[flat.tokens.index(7)] == pytest.approx(0.5 * 0.4)  # (1 - alpha) * chance
    assert flat.tokens.count(3) == 1  # the chain's own token is not offered again beside itself
    registry = DraftRegistry()
    registry.publish("d", tiny_torch_model(7))
    proposer = DraftModelProposer(registry, "d", VOCAB)
    engine = engine_with(runner, proposer, k=3, adaptive=False)
    assert proposer.runners_up == 3 and proposer.fork().runners_up == 3
    result = engine.generate(PROMPT, SamplingConfig(max_new_tokens=N))
    assert result.token_ids == target_only(runner, PROMPT, N)
    assert engine.runner_up_rates.asks > 0  # measured where the draft's best was rejected
    proposer.begin(PROMPT)
    proposal = proposer.propose(PROMPT, 2, SamplingConfig(max_new_tokens=4))
    assert len(proposal.runners_up) == 2 and all(len(r) == 3 and t not in r for r, t in zip(proposal.runners_up, proposal.tokens))
    chains = SpeculativeEngine(runner, ByteTokenizer(), DraftModelProposer(registry, "d", VOCAB), SpeculationConfig(k=3))
    assert chains.sources[0].runners_up == 0 and chains.runner_up_rates is None  # chains only: no extra work
