"""The feature head served (propose/feature_head.py): it reads the target's feature at the row that emitted each
sequence's last token, bitwise what the target computes there; greedy answers stay the target's own, alone and in a
batch; sampled proposals carry their q; a target that cannot hand back features is refused by name."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_qwen2

from osd.config import SamplingConfig, SpeculationConfig
from osd.drafts import DraftRegistry
from osd.engine import SpeculativeEngine
from osd.errors import InvalidArgument
from osd.models.feature_head import FeatureHead
from osd.propose import DraftModelProposer
from osd.propose.chain import Sources
from osd.propose.feature_head import FeatureHeadProposer
from tests.models.tiny_gguf import ByteTokenizer, tiny, tiny_q4  # noqa: F401  (fixtures)

MAP = 64  # the head proposes among target ids 0..63




class SpyHead(FeatureHeadProposer):
    """Notes every (position, feature) the scheduler hands it, and every proposal it makes."""

    seen: list

    def observe_feature(self, position, feature):
        self.seen.append((position, feature.clone()))
        super().observe_feature(position, feature)

    def fork(self):
        fork = SpyHead(self.registry, self.name, self.embed, self.vocab_size)
        fork.seen = self.seen
        return fork


def head_engine(runner, vocab, draft=None, k=3, max_batch=1, seed=0):
    torch.manual_seed(seed)
    registry = DraftRegistry()
    registry.publish("head", FeatureHead(runner.shape.hidden, 32, torch.randn(MAP, runner.shape.hidden)).eval(),
                     torch.arange(MAP))
    head = SpyHead(registry, "head", runner.embed, vocab)
    head.seen = []
    sources = [head]
    if draft is not None:
        registry.publish("draft", draft)
        sources.append(DraftModelProposer(registry, "draft", vocab))
    engine = SpeculativeEngine(runner, ByteTokenizer(), Sources(sources), SpeculationConfig(k=k, adaptive=False,
                                                                                   max_batch=max_batch))
    return engine, head


def target_alone(runner, prompt, n):
    engine = SpeculativeEngine(runner, ByteTokenizer(), None, SpeculationConfig(k=0))
    return engine.generate(prompt, SamplingConfig(max_new_tokens=n, ignore_eos=True)).token_ids


def test_the_head_reads_the_targets_feature_at_the_row_that_chose_the_pending_token(tiny_q4):
    from tests.models.tiny_gguf import PROMPT

    runner, vocab = tiny_q4
    engine, head = head_engine(runner, vocab)
    result = engine.generate(PROMPT, SamplingConfig(max_new_tokens=16, ignore_eos=True))
    sequence = PROMPT + result.token_ids
    runner.reset()
    features = runner.features(runner._forward(sequence))  # (len, H): the LM head's input at every position
    assert len(head.seen) >= 5 and sum(k for k, _ in result.steps) > 0  # the head proposed
    for position, feature in head.seen:
        assert torch.equal(feature, features[position]), position
    assert [p for p, _ in head.seen] == sorted({p for p, _ in head.seen})  # one per step, forward only
    assert head.seen[-1][0] == len(sequence) - 2  # the last: before the last emitted token


@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_answers_with_the_head_are_the_targets_alone_and_in_a_batch(tiny_q4, max_batch):
    from tests.models.tiny_gguf import PROMPT

    runner, vocab = tiny_q4
    prompts = [PROMPT, PROMPT[:5], PROMPT[::-1]]
    want = [target_alone(runner, p, 12) for p in prompts]
    engine, head = head_engine(runner, vocab, max_batch=max_batch)
    sched, by_seq, got = engine.scheduler, {}, {}
    for i, p in enumerate(prompts[: sched.capacity]):
        by_seq[id(sched.add(p, SamplingConfig(max_new_tokens=12, ignore_eos=True)))] = i
    pending = list(enumerate(prompts))[sched.capacity :]
    while sched.running or pending:
        if pending and len(sched.running) < sched.capacity:
            i, p = pending.pop(0)
            by_seq[id(sched.add(p, SamplingConfig(max_new_tokens=12, ignore_eos=True)))] = i
        for seq in sched.step():
            assert seq.error is None, seq.error
            got[by_seq[id(seq)]] = seq.result.token_ids
    assert [got[i] for i in range(len(prompts))] == want
    assert sched.stats.proposed > 0  # the head proposed (k is fixed: every step past the first)


def test_a_head_with_a_draft_behind_it_lets_the_draft_propose_the_first_step(tiny_q4):
    from tests.models.tiny_gguf import PROMPT, tiny_torch_model

    runner, vocab = tiny_q4
    engine, head = head_engine(runner, vocab, draft=tiny_torch_model(3))
    result = engine.generate(PROMPT, SamplingConfig(max_new_tokens=10, ignore_eos=True))
    assert result.token_ids == target_alone(runner, PROMPT, 10)
    assert result.steps[0][0] == 3  # no feature yet: the draft proposed


def test_sampled_proposals_carry_the_heads_warped_q_over_its_map(tiny_q4):
    from tests.models.tiny_gguf import PROMPT

    runner, vocab = tiny_q4
    engine, head = head_engine(runner, vocab)
    seen = []
    engine.observers.append(seen.append)
    engine.generate(PROMPT, SamplingConfig(max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True))
    records = [r for r in seen if r.proposed]
    assert records
    for r in records:
        q = r.draft_probs  # (k, V)
        assert q.shape == (len(r.proposed), vocab) and torch.allclose(q.sum(-1), torch.ones(len(r.proposed)))
        assert float(q[:, MAP:].sum()) == 0.0  # nothing outside the map
        assert all(q[i, t] > 0 for i, t in enumerate(r.proposed))
        assert r.target_features.shape == (len(r.proposed) + 1, runner.shape.hidden)


def test_a_target_without_features_is_refused_by_name():
    target = tiny_qwen2(seed=0)
    registry = DraftRegistry()
    registry.publish("head", FeatureHead(8, 16, torch.randn(MAP, 8)), torch.arange(MAP))
    head = FeatureHeadProposer(registry, "head", lambda ids: torch.zeros(len(ids), 8), target.config.vocab_size)
    with pytest.raises(InvalidArgument, match="only osd's Q4 backend"):
        SpeculativeEngine(target, ByteTokenizer(), head, SpeculationConfig(k=3))
