"""`osd eval` measures the copy that serves (--draft-quantize, --draft-vocab): its runner's logits at every response
position, checked against that copy fed one token at a time, the way a proposer asks it."""
from __future__ import annotations

import pytest
import torch
from conftest import EOS, require_q4, tiny_qwen2

from osd.distill.cache import DecodeSettings, TargetCache
from osd.distill.evaluate import position_stats, sample_item, serving_stats, summarize
from osd.distill.run import evaluate_draft
from osd.distill.target_outputs import target_samples
from osd.models.cached import CachedModel
from osd.propose.copy_choice import serving_copy
from osd.propose.draft_model import serving_runner

PROMPTS = [[5, 9, 11], [7, 8, 9, 10, 12, 13], [20], [3, 4, 30, 31]]


@pytest.fixture
def draft_model():
    return tiny_qwen2(seed=1, layers=1, hidden=64)  # head dim 16: a draft the Q4 copy takes


@pytest.fixture
def samples(target_model, tmp_path):
    return target_samples(TargetCache(tmp_path, "fp"), target_model, PROMPTS, DecodeSettings(max_new_tokens=12, top_k=8), {EOS})


def _runner(copy):
    return serving_runner(copy.serving) or CachedModel(copy.serving)


def _proposals_one_at_a_time(copy, sample) -> list[int]:
    """The copy's greedy pick at each response position, fed as a proposer feeds it (prompt, then a token at a time),
    mapped to target ids through the copy's vocabulary map."""
    runner = _runner(copy)
    runner.reset()
    n = len(sample.prompt_ids)
    picks = [runner.feed(sample.tokens[:n])[0]] + [runner.feed([t])[0] for t in sample.response_ids[:-1]]
    ids = torch.stack(picks).argmax(-1)
    return (ids if copy.vocab_ids is None else copy.vocab_ids[ids]).tolist()


@pytest.mark.parametrize("quantize", ["none", "int8", "q4"])
def test_serving_stats_are_the_copys_own_proposals(samples, draft_model, quantize):
    if quantize == "q4":
        require_q4()
    copy = serving_copy(draft_model, quantize)
    stats = serving_stats(_runner(copy), copy.vocab_ids, draft_model.config.vocab_size, samples)
    for sample, row in zip(samples, stats):
        picks = _proposals_one_at_a_time(copy, sample)
        assert row["matches"] == [p == t for p, t in zip(picks, sample.response_ids)]
        assert len(row["beta"]) == len(sample.response_ids) and all(0 <= b <= 1 + 1e-6 for b in row["beta"])
    if quantize == "none":  # the float copy through its runner = the master teacher-forced in torch
        master = position_stats(draft_model, [sample_item(s) for s in samples], samples)
        assert [r["matches"] for r in stats] == [r["matches"] for r in master]
        for a, b in zip(stats, master):
            assert a["beta"] == pytest.approx(b["beta"], abs=1e-4)


def test_a_narrowed_head_is_measured_over_its_map(samples, draft_model):
    """--draft-vocab 16: the copy proposes only ids < 16 (and the special ones), and eval scores exactly that."""
    copy = serving_copy(draft_model, "none", draft_vocab=16, keep_ids=[EOS])
    assert copy.vocab_ids is not None and len(copy.vocab_ids) < draft_model.config.vocab_size
    stats = serving_stats(_runner(copy), copy.vocab_ids, draft_model.config.vocab_size, samples)
    allowed = set(copy.vocab_ids.tolist())
    for sample, row in zip(samples, stats):
        picks = _proposals_one_at_a_time(copy, sample)
        assert set(picks) <= allowed
        assert row["matches"] == [p == t for p, t in zip(picks, sample.response_ids)]
        assert not any(m for m, t in zip(row["matches"], sample.response_ids) if t not in allowed)


def test_evaluate_draft_names_the_copy_it_measured(samples, draft_model):
    draft = draft_model
    master = evaluate_draft(draft, samples, k=3)
    copy = serving_copy(draft, "int8")
    served = evaluate_draft(draft, samples, k=3, copy=copy)
    assert "serving_copy" not in master and served["serving_copy"] == "int8"
    assert served["copy_seconds_per_token"] is None  # named, not timed
    stats = serving_stats(_runner(copy), None, draft.config.vocab_size, samples)
    assert served["alpha_greedy"] == summarize(stats, 3)["alpha_greedy"]
    assert served["positions"] == master["positions"] == sum(len(s.response_ids) for s in samples)


def test_the_eval_table_names_each_drafts_copy():
    from osd.distill.report import COLUMNS, eval_table

    row = {key: 0.5 for _, key in COLUMNS}
    header, _, *lines = eval_table({"drafts": {"a": {**row, "serving_copy": "q4"}, "b": row}}).splitlines()
    assert [c.strip() for c in header.strip("|").split("|")][:2] == ["draft", "copy"]
    assert [[c.strip() for c in line.strip("|").split("|")][1] for line in lines] == ["q4", "none"]
    assert "copy" not in eval_table({"drafts": {"b": row}})  # the float master alone: no column
