"""The draft runner on compiled glue (models/glue_draft.py): the same serving copy as the transformers runner,
the same greedy proposals, row invariance, a cache that grows, and a clear 'does not qualify' otherwise."""
from __future__ import annotations

import pytest
from conftest import require_glue
import torch

from osd.config import SamplingConfig
from osd.drafts import DraftRegistry
from osd.errors import ContextTooLong
from osd.models import glue_draft, kernels
from osd.models.cached import CachedModel
from osd.models.glue_draft import GlueDraftRunner, glue_draft_runner, qualifies
from osd.models.serving_draft import make_serving_draft
from osd.propose.draft_model import DraftModelProposer
from tests.conftest import tiny_qwen2

VOCAB = 48


def _serving(seed: int = 3, tied: bool = False, hidden: int = 64, quantize: str = "int8", **kw):
    master = tiny_qwen2(seed, hidden=hidden, vocab=VOCAB, tied=tied, **kw)
    serving, _ = make_serving_draft(master, quantize)
    return serving


@pytest.fixture(params=["int8", "int8_vnni"])
def serving(compiled, request):
    """The int8 serving copy, and the int8_vnni one (activations int8 too) where the CPU has AVX-512 VNNI."""
    require_glue()
    if request.param == "int8_vnni" and not kernels.vnni_available():
        pytest.skip("int8_vnni needs a CPU with AVX-512 VNNI")
    return _serving(quantize=request.param)


def test_logits_match_the_transformers_runner_and_greedy_is_identical(serving):
    glue_runner, reference = glue_draft_runner(serving), CachedModel(serving)
    assert isinstance(glue_runner, GlueDraftRunner)
    assert glue_runner.vnni == serving.lm_head.vnni  # the glue multiplies as the serving copy's own linears do
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = glue_runner.feed(tokens[:20], n_logits=3), reference.feed(tokens[:20], n_logits=3)
    assert a.shape == b.shape == (3, VOCAB)
    torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    for t in tokens[20:]:
        a, b = glue_runner.feed([t]), reference.feed([t])
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
        assert int(a.argmax()) == int(b.argmax())
    # a rollback keeps the prefix: feeding the same tokens again gives the same logits
    glue_runner.rollback(30)
    again = glue_runner.feed(tokens[30:], n_logits=len(tokens) - 30)
    reference.rollback(30)
    torch.testing.assert_close(again, reference.feed(tokens[30:], n_logits=len(tokens) - 30), atol=2e-4, rtol=1e-4)


def test_a_position_gives_the_same_bits_whatever_the_rows_fed_with_it(serving):
    runner = glue_draft_runner(serving)
    runner.feed(list(range(1, 12)))
    for rows in range(2, 8):
        runner.rollback(11)
        together = runner.feed(list(range(20, 20 + rows)), n_logits=rows)
        runner.rollback(11)
        alone = torch.cat([runner.feed([t]) for t in range(20, 20 + rows)])
        assert torch.equal(together, alone), rows


def test_the_cache_grows_beyond_its_first_allocation_and_keeps_what_it_held(serving, monkeypatch):
    tokens = [(7 * i + 3) % VOCAB for i in range(60)]
    big = glue_draft_runner(serving)
    want = torch.cat([big.feed(tokens[:5], n_logits=5)] + [big.feed([t]) for t in tokens[5:]])
    monkeypatch.setattr(glue_draft, "INITIAL_CONTEXT", 8)
    small = glue_draft_runner(serving)
    assert small._capacity == 8
    got = torch.cat([small.feed(tokens[:5], n_logits=5)] + [small.feed([t]) for t in tokens[5:]])
    assert small._capacity >= 60
    assert torch.equal(got, want)


def test_feeding_past_the_models_context_is_refused(serving):
    runner = glue_draft_runner(serving)
    limit = serving.config.max_position_embeddings
    runner.feed([i % VOCAB for i in range(limit - 1)])
    with pytest.raises(ContextTooLong):
        runner.feed([1, 2])
    assert runner.length == limit - 1  # nothing half-written


def test_models_that_do_not_qualify_say_why_and_keep_the_transformers_runner(compiled):
    require_glue()
    float_model = tiny_qwen2(3, hidden=64, vocab=VOCAB)
    assert qualifies(float_model) == "not an int8 serving copy"
    assert glue_draft_runner(float_model) is None
    mixed = _serving()
    mixed.model.layers[0].mlp.down_proj.vnni = True  # one linear on the other path: refused, not silently mixed
    assert qualifies(mixed) == "int8 and int8_vnni linears mixed"
    narrow = _serving(hidden=32)  # head dim 8: the glue's RoPE needs half a head to be a multiple of 8
    assert "multiples" in qualifies(narrow)
    registry = DraftRegistry()
    registry.publish("d", narrow)
    proposer = DraftModelProposer(registry, "d", VOCAB)
    proposer.begin([1, 2, 3])
    assert isinstance(proposer.runner, CachedModel)


@pytest.mark.parametrize("vocab_ids", [None, torch.tensor([0, 1, 2, 5, 8, 13, 21, 30, 40, 44, 46, 47] + list(range(12, 12)))])
def test_the_proposer_drafts_on_the_glue_runner_the_tokens_the_transformers_runner_drafts(serving, vocab_ids):
    if vocab_ids is not None:  # a derived draft's map: its head covers these target ids, in increasing order
        serving.lm_head.weight_int8 = serving.lm_head.weight_int8[: len(vocab_ids)].clone()
        serving.lm_head.scale = serving.lm_head.scale[: len(vocab_ids)].clone()
        serving.lm_head.out_features = len(vocab_ids)
    registry = DraftRegistry()
    registry.publish("d", serving, vocab_ids)
    fast = DraftModelProposer(registry, "d", VOCAB)
    fast.begin([1])
    assert isinstance(fast.runner, GlueDraftRunner)
    slow = DraftModelProposer(registry, "d", VOCAB)
    slow.begin([1])
    slow.runner = CachedModel(serving)
    greedy = SamplingConfig(max_new_tokens=8)
    context = [1, 5, 9, 2, 7]
    for _ in range(4):
        a, b = fast.propose(context, 3, greedy), slow.propose(context, 3, greedy)
        assert a.tokens == b.tokens
        assert vocab_ids is None or set(a.tokens) <= set(vocab_ids.tolist())
        context = context + a.tokens[:2]  # two accepted: both runners roll back the third
        fast.rollback(len(context) - 1)
        slow.rollback(len(context) - 1)


def test_draft_cost_times_either_runner_and_refuses_an_unknown_one(serving):
    from osd.distill.draft_cost import draft_token_seconds, run_draft_cost
    from osd.errors import InvalidArgument

    for runner in ("glue", "transformers"):
        assert draft_token_seconds(serving, None, VOCAB, context=8, tokens=4, runner=runner) > 0
    with pytest.raises(InvalidArgument, match="draft runners"):
        run_draft_cost("unused", None, [2], [16], runners=("glue", "onnx"))


def test_stacked_matrices_share_the_serving_copys_memory_and_leave_its_forward_unchanged(serving):
    ids = torch.tensor([[3, 7, 9, 11, 2, 5]])
    before = serving(ids).logits.clone()
    first = glue_draft_runner(serving)
    attn = serving.model.layers[0].self_attn
    stacked = first.layers[0].qkv[0]
    for x in (attn.q_proj, attn.k_proj, attn.v_proj):  # the copy's linears read rows of the stacked matrix
        assert x.weight_int8.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    assert torch.equal(serving(ids).logits, before)  # same values: the transformers forward is unchanged
    second = glue_draft_runner(serving)  # another runner (another engine) over the same copy reuses it
    assert second.layers[0].qkv[0] is stacked and second.layers[0].gate_up[0] is first.layers[0].gate_up[0]
    tokens = [1, 4, 9, 16, 25]
    assert torch.equal(first.feed(tokens, n_logits=5), second.feed(tokens, n_logits=5))


def test_runners_fed_together_get_the_bits_of_their_own_feeds(serving):
    """Three sequences' draft forwards in one (`feed_together`: prompts of different lengths, then single tokens
    beside a several-token catch-up): each row's logits and each cache are bitwise those of its runner fed alone."""
    from osd.models.glue_draft import feed_together

    together, alone = [glue_draft_runner(serving) for _ in range(3)], [glue_draft_runner(serving) for _ in range(3)]
    for feeds in ([[1, 2, 3, 4, 5], [9, 8], [30, 31, 32, 33, 34, 35, 36]], [[7], [10, 11, 12], [40]], [[2], [3], [4]]):
        want = torch.cat([r.feed(f) for r, f in zip(alone, feeds)])
        got = feed_together(together, feeds)
        assert got.shape == (3, VOCAB) and torch.equal(got, want)
        assert [r.length for r in together] == [r.length for r in alone]
    with pytest.raises(ValueError):  # one pass over one draft's weights: runners of another model cannot join
        feed_together([together[0], glue_draft_runner(_serving(seed=4))], [[1], [2]])


def test_proposing_together_gives_each_sequence_the_proposal_it_gets_alone(serving):
    """`propose_together` (the scheduler's batched drafting): greedy and sampled sequences, each with its own k and
    generator, get the tokens, draft probabilities and weights they get from `propose` alone, and their caches end
    where `propose` leaves them."""
    from osd.propose.draft_model import propose_together

    registry = DraftRegistry()
    registry.publish("d", serving)
    contexts, ks = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12]], [3, 1, 4]
    samplings = [SamplingConfig(max_new_tokens=8), SamplingConfig(max_new_tokens=8, temperature=0.9),
                 SamplingConfig(max_new_tokens=8, temperature=1.3, top_k=10)]

    def proposers():
        made = [DraftModelProposer(registry, "d", VOCAB) for _ in contexts]
        for p, context in zip(made, contexts):
            p.begin(context, prefill=context is not contexts[2])  # the third catches up on its first forward
        return made

    def generators():
        return [torch.Generator().manual_seed(i) for i in range(len(contexts))]

    solo = proposers()
    alone = [p.propose(c, k, s, g) for p, c, k, s, g in zip(solo, contexts, ks, samplings, generators())]
    joint = proposers()
    together = propose_together(joint, contexts, ks, samplings, generators())
    assert all(isinstance(p.runner, GlueDraftRunner) for p in joint)
    for a, b in zip(alone, together):
        assert a.tokens == b.tokens and len(b.tokens) in ks and a.weights == b.weights
        assert (a.draft_probs is None) == (b.draft_probs is None)
        assert a.draft_probs is None or torch.equal(a.draft_probs, b.draft_probs)
    assert [p.runner.length for p in joint] == [p.runner.length for p in solo]
    assert [len(b.single_token_seconds) for b in together] == [2, 0, 3]  # the catch-up forward is not timed
