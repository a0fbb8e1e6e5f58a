"""The feature head's online learner (learn/head.py): chains built from verification line up with the sequence; a
server that serves the same traffic again proposes better with each published head version; a failed or harmful
update never replaces the serving head; it keeps the share of a busy engine it is given."""
from __future__ import annotations

import pytest
import torch

from osd.config import SamplingConfig, SpeculationConfig
from osd.drafts import DraftRegistry
from osd.engine import SpeculativeEngine
from osd.errors import InvalidArgument
from osd.learn.head import HeadLearnConfig, HeadLearner
from osd.learn.head_chains import chains_of_sequence
from osd.models.feature_head import FeatureHead
from osd.propose.chain import Sources
from osd.propose.feature_head import FeatureHeadProposer
from tests.models.tiny_gguf import ByteTokenizer, tiny, tiny_q4  # noqa: F401  (fixtures)


def test_chains_of_a_sequence_read_the_feature_at_t_and_the_token_at_t_plus_1_and_hit_t_plus_2():
    tokens = [7, 8, 9, 10, 11, 12, 13]
    first = 2  # features of positions 2 .. 5 (the last committed token, at 6, is pending: never fed)
    features = torch.arange(4, dtype=torch.float32)[:, None].repeat(1, 3)  # row r: position first + r
    index = torch.full((20,), -1)
    index[torch.tensor([9, 10, 11, 12, 13])] = torch.tensor([0, 1, 2, 3, 4])
    embed = lambda ids: torch.tensor(ids, dtype=torch.float32)[:, None].repeat(1, 3)  # noqa: E731
    chains = chains_of_sequence(tokens, first, features, embed, index, depth=3)
    assert chains.rows.tolist() == [0, 1, 2]  # starts t = 2, 3, 4 (t + 2 <= 6 and the truth feature at t + 1 kept)
    assert chains.features[chains.rows][:, 0].tolist() == [0.0, 1.0, 2.0]  # the feature at t
    assert chains.first_embedding[:, 0].tolist() == [10.0, 11.0, 12.0]  # the token at t + 1
    assert chains.labels.tolist() == [[2, 3, 4], [3, 4, -1], [4, -1, -1]]  # map rows of t + 2 + d; -1 past the end
    assert chains_of_sequence(tokens[:3], 1, features[:1], embed, index, 3) is None  # nothing to hit


def test_chain_lengths_are_the_leading_hits_of_the_full_chains():
    from osd.learn.head_chains import Chains, chain_lengths, head_chains, leading_hits

    torch.manual_seed(0)
    head = FeatureHead(8, 16, torch.randn(5, 8)).eval()
    map_embeddings = torch.randn(5, 8)
    chains = Chains(torch.randn(30, 8), torch.arange(20), torch.randn(20, 8), torch.zeros(20, 4, dtype=torch.long))
    with torch.no_grad():  # the head's own greedy chains: labels that it hits all the way
        feature, embedding = chains.features[chains.rows], chains.first_embedding
        for d in range(4):
            logits, feature = head.step(feature, embedding)
            chains.labels[:, d] = logits.argmax(-1)
            embedding = map_embeddings[chains.labels[:, d]]
    miss_at = torch.arange(20) % 5  # chain i misses at proposal i % 5 (4: never)
    for i, d in enumerate(miss_at.tolist()):
        if d < 4:
            chains.labels[i, d] = -1
    with torch.no_grad():
        want = leading_hits(head_chains(head, chains, map_embeddings, 4))
    assert torch.equal(want, miss_at)
    assert torch.equal(chain_lengths(head, chains, map_embeddings, 4), want)
    assert torch.equal(chain_lengths(head, chains, map_embeddings, 4, torch.tensor([3, 9])), want[[3, 9]])




def test_a_request_with_tokens_past_the_maps_highest_id_becomes_chains_that_miss_there():
    from types import SimpleNamespace

    head = FeatureHead(8, 16, torch.randn(10, 8))
    learner = HeadLearner(head, torch.arange(10), 100, lambda ids: torch.zeros(len(ids), 8), lambda h: None,
                          HeadLearnConfig(head_schedule="sync", head_every_requests=100))
    for context in ([1, 2, 3], [1, 2, 3, 50, 4]):  # each step: the pending token and one accepted proposal
        learner.observe(SimpleNamespace(request_id="r", context=context, target_features=torch.randn(2, 8),
                                        n_accepted=1))
    learner.after_request(SimpleNamespace(request_id="r", prompt_ids=[1, 2, 3], token_ids=[50, 4, 60, 5]))
    assert not learner.train and len(learner.finished) == 1  # the serving thread only queues it
    learner.absorb()  # the learner's thread makes it chains
    (piece,) = learner.train  # starts t = 2, 3, 4: the target's tokens 4, 60 (off the map), 5 at t + 2
    assert piece.labels[:, 0].tolist() == [4, -1, 5]


def served_with_learner(runner, vocab, **config):
    torch.manual_seed(0)
    hidden, vocab_ids = runner.shape.hidden, torch.arange(vocab)
    master = FeatureHead(hidden, 64, 0.01 * torch.randn(vocab, hidden))
    registry = DraftRegistry()
    publish = lambda head: registry.publish("head", __import__("copy").deepcopy(head).eval(), vocab_ids)  # noqa: E731
    publish(master)
    engine = SpeculativeEngine(runner, ByteTokenizer(), Sources([FeatureHeadProposer(registry, "head", runner.embed, vocab)]),
                               SpeculationConfig(k=4, adaptive=False))
    learner = HeadLearner(master, vocab_ids, vocab, runner.embed, publish,
                          HeadLearnConfig(head_schedule="sync", **config)).attach(engine)
    return engine, learner, registry


def test_a_server_serving_the_same_traffic_again_accepts_more_with_each_head_version(tiny_q4):
    from tests.models.tiny_gguf import PROMPT

    runner, vocab = tiny_q4
    engine, learner, registry = served_with_learner(runner, vocab, head_every_requests=2, head_steps_per_update=25,
                                                    head_lr=3e-3, head_batch=32, head_holdout_every=3)
    sampling = SamplingConfig(max_new_tokens=24, ignore_eos=True)
    plain = SpeculativeEngine(runner, ByteTokenizer(), None, SpeculationConfig(k=0)).generate(PROMPT, sampling).token_ids
    accepted = []
    for _ in range(12):
        result = engine.generate(PROMPT, sampling)
        assert result.token_ids == plain  # greedy: the target's answer whatever the head proposes
        accepted.append(sum(a for _, a in result.steps))
    assert learner.counters["updates_published"] >= 2 and registry.get("head").version == learner.version
    assert learner.counters["optimizer_steps"] > 0
    assert max(accepted[-3:]) >= accepted[0] + 6, accepted  # the untrained head hits ~nothing; learnt, it does
    assert learner.stats()["holdout_starts"] > 0 and learner.last_update["accepted_after"] is not None


def test_a_failed_update_and_a_guard_rejection_leave_the_serving_head_and_its_weights(tiny_q4, monkeypatch):
    from osd.learn import head as head_module
    from tests.models.tiny_gguf import PROMPT

    runner, vocab = tiny_q4
    engine, learner, registry = served_with_learner(runner, vocab, head_every_requests=2, head_steps_per_update=25,
                                                    head_lr=3e-3, head_batch=32, head_holdout_every=3)
    sampling = SamplingConfig(max_new_tokens=24, ignore_eos=True)
    for _ in range(8):  # a head that has learnt this traffic serves
        engine.generate(PROMPT, sampling)
    learner.config.head_every_requests = 100  # no more updates but the ones asked for below
    serving, weights = registry.get("head"), [p.detach().clone() for p in learner.params]

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(head_module, "unrolled_loss", broken)
    with pytest.raises(RuntimeError, match="boom"):
        learner.update()
    assert registry.get("head") is serving and learner.counters["update_errors"] == 1
    assert all(torch.equal(p, w) for p, w in zip(learner.params, weights))
    monkeypatch.undo()

    loss = head_module.unrolled_loss

    def harmful(head, *args, **kwargs):  # the candidate is made to propose nothing the target says
        out = loss(head, *args, **kwargs)
        with torch.no_grad():
            head.head.weight.mul_(-1.0)
        return out

    learner.config.head_guard_z = 0.0  # any drop rejects
    monkeypatch.setattr(head_module, "unrolled_loss", harmful)
    report = learner.update()
    assert report["accepted_before"] > 0.5 and report["accepted_after"] < report["accepted_before"]
    assert report["rejected_because"] == "guard"
    assert registry.get("head") is serving and learner.counters["updates_rejected"] == 1
    assert all(torch.equal(p, w) for p, w in zip(learner.params, weights))


def test_the_head_learner_refuses_a_config_without_training_requests():
    with pytest.raises(InvalidArgument, match="holdout"):
        HeadLearnConfig(head_holdout_every=1)
    with pytest.raises(InvalidArgument, match=">= 1"):
        HeadLearnConfig(head_batch=0)
