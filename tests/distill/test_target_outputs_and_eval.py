"""Batched decoding, the content-addressed teacher cache, and exact greedy acceptance from cached outputs."""
import pytest
import torch
from conftest import EOS, tiny_qwen2
from helpers import make_engine, plain_greedy

from osd.config import SamplingConfig
from osd.distill.cache import DecodeSettings, TargetCache
from osd.distill.evaluate import agreement_by_confidence, greedy_steps, position_stats, sample_item, summarize
from osd.distill.generate import _lockstep, decode_batch, row_seed
from osd.distill.target_outputs import target_samples
from osd.errors import InvalidArgument

PROMPTS = [[5, 9, 11], [7, 8, 9, 10, 12, 13], [20], [3, 4, 30, 31]]


class Counting(torch.nn.Module):
    """Wraps a model and counts forwards (to prove the cache skips work)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls, self.config = model, 0, model.config

    def forward(self, **kw):
        self.calls += 1
        return self.model(**kw)


def test_batched_greedy_rows_equal_single_sequence_greedy(target_model):
    settings = DecodeSettings(max_new_tokens=10, top_k=5)
    out = decode_batch(target_model, PROMPTS, settings, {EOS})
    for prompt, (response, dist) in zip(PROMPTS, out):
        ref = plain_greedy(target_model, prompt, 10, eos=EOS)
        assert response == (ref + [EOS] if len(ref) < 10 else ref)  # EOS is part of the response when reached
        assert dist.ids.shape == (len(response), 5)
        assert (dist.ids[:, 0] == torch.tensor(response)).all()  # greedy: the token is the top-1 of its distribution


def test_sources_choose_tokens_from_the_right_model(target_model, draft_model):
    settings = DecodeSettings(max_new_tokens=8, top_k=4)
    student = decode_batch(target_model, PROMPTS, settings, set(), draft=draft_model, source="student")
    for prompt, (response, dist) in zip(PROMPTS, student):
        assert response == plain_greedy(draft_model, prompt, 8)  # draft-generated ...
        assert dist.ids.shape[0] == len(response)  # ... scored by the target at every position
    all_teacher = decode_batch(target_model, PROMPTS, settings, set(), draft=draft_model, source="mix_token", teacher_ratio=1.0)
    assert [r for r, _ in all_teacher] == [r for r, _ in decode_batch(target_model, PROMPTS, settings, set())]
    mixed = decode_batch(target_model, PROMPTS * 4, settings, set(), draft=draft_model, source="mix_request", teacher_ratio=0.5)
    teacher_like = sum(r == plain_greedy(target_model, p, 8) for p, (r, _) in zip(PROMPTS * 4, mixed))
    assert 0 < teacher_like < 16
    with pytest.raises(InvalidArgument, match="needs a draft"):
        decode_batch(target_model, PROMPTS, settings, set(), source="student")
    with pytest.raises(InvalidArgument, match="source"):
        decode_batch(target_model, PROMPTS, settings, set(), draft=draft_model, source="oracle")


def test_student_rows_scored_afterwards_equal_scoring_in_lockstep(target_model, draft_model):
    """Draft-alone generation + one teacher-forced target forward == the target decoding beside the draft."""
    settings = DecodeSettings(max_new_tokens=8, top_k=4)
    student = decode_batch(target_model, PROMPTS, settings, set(), draft=draft_model, source="student")
    gens = [torch.Generator().manual_seed(row_seed(0, p)) for p in PROMPTS]
    lockstep = _lockstep(target_model, draft_model, PROMPTS, gens, settings, set(), 0, lambda b: False)
    for (response, dist), (ref_response, ref_dist) in zip(student, lockstep):
        assert response == ref_response
        assert torch.equal(dist.ids, ref_dist.ids)
        assert torch.allclose(dist.probs, ref_dist.probs, atol=1e-4)


def test_sampled_rows_do_not_depend_on_batch_neighbours(target_model):
    settings = DecodeSettings(max_new_tokens=8, temperature=1.0, seed=3)
    alone = decode_batch(target_model, PROMPTS[:1], settings, set())[0][0]
    together = decode_batch(target_model, PROMPTS, settings, set())[0][0]
    assert alone == together


def test_cache_is_content_addressed_and_a_refill_generates_nothing(tmp_path, target_model):
    counting = Counting(target_model)
    settings = DecodeSettings(max_new_tokens=6, top_k=4)
    cache = TargetCache(tmp_path, "fp")
    first = target_samples(cache, counting, PROMPTS[:2], settings, {EOS}, batch_size=2)
    calls = counting.calls
    again = target_samples(cache, counting, PROMPTS, settings, {EOS}, batch_size=8)  # 2 cached + 2 new
    assert counting.calls - calls <= 7  # one batch (prefill + <= 6 steps) for the two missing prompts only
    assert [s.response_ids for s in again[:2]] == [s.response_ids for s in first]
    assert torch.equal(again[0].target.ids, first[0].target.ids)
    assert (PROMPTS[0], DecodeSettings(max_new_tokens=7, top_k=4)) not in cache  # settings are part of the key
    assert TargetCache(tmp_path, "other-target").get(PROMPTS[0], settings) is None
    assert not list(tmp_path.rglob("*.tmp*"))


def test_greedy_steps_pure_cases():
    assert greedy_steps([True, True, False, True, True, True, True, True], 4) == [(0, 2, 4), (3, 4, 4)]
    assert greedy_steps([False, False], 4) == [(0, 0, 4), (1, 0, 4)]
    assert greedy_steps([True] * 5, 2) == [(0, 2, 2), (3, 2, 2)]
    assert greedy_steps([True] * 5, 4, max_new_tokens=5) == [(0, 4, 4)]  # the 5th token is the target's own
    assert greedy_steps([True, False, True], 4, max_new_tokens=3) == [(0, 1, 2), (2, 0, 0)]


def test_fast_path_acceptance_equals_the_engine_greedy_run(target_model, draft_model, tokenizer, tmp_path):
    """The claim behind the fast-path replay: cached target output + one draft forward = the engine's steps."""
    settings = DecodeSettings(max_new_tokens=16, top_k=8)
    samples = target_samples(TargetCache(tmp_path, "fp"), target_model, PROMPTS, settings, {EOS})
    stats = position_stats(draft_model, [sample_item(s) for s in samples], samples)
    engine, _ = make_engine(target_model, draft_model, tokenizer, k=3)
    for sample, st in zip(samples, stats):
        steps = []
        engine.observers.append(lambda r: steps.append((len(r.proposed), r.n_accepted)))
        result = engine.generate(sample.prompt_ids, SamplingConfig(max_new_tokens=16))
        engine.observers.clear()
        assert result.token_ids == [t for t in sample.response_ids if t != EOS]
        predicted = [(p, a) for _, a, p in greedy_steps(st["matches"], 3, 16)]
        assert steps == predicted
    summary = summarize(stats, 3, {"c": 0.1, "verify_cost": [1.0, 1.2, 1.3, 1.4]}, 16)
    assert 0 <= summary["alpha_greedy"] <= 1 and summary["tokens_per_step_greedy"] >= 1
    assert summary["implied_speedup_greedy"] > 0 and 0 < summary["alpha_sampling_t1"] <= 1
    buckets = summary["by_target_confidence"]  # the same positions, split by the target's top-1 probability
    assert abs(sum(b["share"] for b in buckets) - 1) < 1e-9
    assert abs(sum(b["share"] * (b["agreement"] or 0) for b in buckets) - summary["alpha_greedy"]) < 1e-9
    by_draft = summary["by_draft_confidence"]  # ... and by the draft's own top-1 probability
    assert len(by_draft) == 7 and abs(sum(b["share"] for b in by_draft) - 1) < 1e-9
    assert abs(sum(b["share"] * (b["agreement"] or 0) for b in by_draft) - summary["alpha_greedy"]) < 1e-9
    top1 = [p for st in stats for p in st["draft_top1"]]
    assert all(0 < p <= 1 for p in top1) and len(set(top1)) > 1


def test_agreement_by_confidence_buckets():
    top1, matches = [0.2, 0.5, 0.95, 1.0, 0.89, 0.3], [False, True, True, True, False, True]
    buckets = agreement_by_confidence(top1, matches)
    assert [b["bucket"] for b in buckets] == ["[0.0, 0.5)", "[0.5, 0.9)", "[0.9, 1.0]"]
    assert [b["share"] for b in buckets] == [2 / 6, 2 / 6, 2 / 6]
    assert [b["agreement"] for b in buckets] == [0.5, 0.5, 1.0]
    assert agreement_by_confidence([0.95], [True])[0]["agreement"] is None  # an empty bucket has no agreement


def test_position_stats_of_a_restricted_head_equal_those_of_its_logits_expanded_to_the_target_vocabulary(
        target_model, draft_model, tmp_path):
    """A derived draft's head covers part of the target's vocabulary: measured over its own columns, its matches and
    1 - TV are those of its logits expanded to the target's vocabulary (-inf outside the map), answer tokens outside
    the map included."""
    import copy

    from osd.distill.evaluate import _stats
    from osd.learn.batch import draft_logits_at
    from osd.models.derived import derive_model
    from osd.models.vocab_map import expand_logits

    settings = DecodeSettings(max_new_tokens=16, top_k=8)
    samples = target_samples(TargetCache(tmp_path, "fp"), target_model, PROMPTS, settings, {EOS})
    vocab = draft_model.config.vocab_size
    answers = sorted({t for s in samples for t in s.response_ids})
    vocab_ids = torch.tensor(sorted(set(answers[::2]) | set(range(0, vocab, 3))))  # some answer tokens left out
    small = derive_model(copy.deepcopy(draft_model), list(range(draft_model.config.num_hidden_layers)), vocab_ids)
    items = [sample_item(s) for s in samples]
    got = position_stats(small, items, samples)
    want = _stats(expand_logits(draft_logits_at(small, items), vocab_ids, vocab), items, samples)
    assert [g["matches"] for g in got] == [w["matches"] for w in want]
    assert any(True in g["matches"] for g in got) and any(False in g["matches"] for g in got)
    for g, w in zip(got, want):
        assert g["beta"] == pytest.approx(w["beta"], abs=1e-5)
        assert g["draft_top1"] == pytest.approx(w["draft_top1"], abs=1e-5)
