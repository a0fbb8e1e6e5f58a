"""Several sequences on one Q4 runner (models/q4_batch.py): bitwise what each sequence gets alone.

The tiny seeded Qwen2 GGUF of tests/models/tiny_gguf.py; the reference is the single-sequence Q4Runner itself, so any
row of one sequence leaking into another's cache, a wrong position, or a slot reused without its reset shows as a
changed logit or answer.
"""
from __future__ import annotations

import pytest
from conftest import require_module, require_q4
import torch

require_module("llama_cpp")  # the tiny GGUF is quantized by llama.cpp, as the real files were

from osd.distill.cache import DecodeSettings, TargetCache  # noqa: E402
from osd.distill.target_outputs import serving_samples  # noqa: E402
from osd.errors import ContextTooLong  # noqa: E402
from osd.models import q4  # noqa: E402
from osd.models.q4_batch import Q4Batch, greedy_alone, greedy_many  # noqa: E402
from osd.models.q4_runner import Q4Runner  # noqa: E402
from tests.models.tiny_gguf import EOS, PROMPT, tiny  # noqa: E402,F401  (tiny: a fixture)

require_q4()

PROMPTS = [PROMPT, PROMPT[:7], PROMPT[3:] + [33, 10], [10], PROMPT[::-1], PROMPT[5:12] * 3]
MAX_TOKENS = [12, 5, 20, 9, 15, 7]


@pytest.fixture(scope="module")
def runner(tiny):
    return Q4Runner(tiny[0], n_ctx=256)


def alone(runner, eos_ids):
    return [greedy_alone(runner, p, m, eos_ids, lambda logits: logits.clone()) for p, m in zip(PROMPTS, MAX_TOKENS)]


def test_rows_of_several_sequences_in_one_forward_are_bitwise_each_sequence_fed_alone(runner):
    a, b = PROMPT[:9], PROMPT[4:]
    batch = Q4Batch(runner, slots=2, n_ctx=64)
    first = batch.feed({0: a, 1: b})  # prompts of different lengths in one forward
    second = batch.feed({0: [65, 66, 67], 1: [68]})  # then 3 rows of one sequence beside 1 of the other
    third = batch.feed({1: [69, 70]})  # one slot alone
    fed = {0: [a, [65, 66, 67]], 1: [b, [68], [69, 70]]}
    got = {0: [first[0], second[0]], 1: [first[1], second[1], third[1]]}
    assert set(third) == {1}
    for slot, chunks in fed.items():
        runner.reset()
        want = [runner.feed(chunk)[0] for chunk in chunks]  # the same tokens, this sequence alone
        for g, w in zip(got[slot], want, strict=True):
            assert torch.equal(g, w)  # bitwise, not within a tolerance
    assert batch.lengths == [len(a) + 3, len(b) + 3]


@pytest.mark.parametrize("slots", [1, 2, 3, 8])
def test_greedy_many_gives_each_prompt_its_own_greedy_answer_and_logits(runner, slots):
    reference = alone(runner, {EOS})
    eos_ids = {EOS, reference[2][0][4]}  # an extra "EOS" that ends one answer early and frees its slot mid-run
    reference = alone(runner, eos_ids)
    assert len(reference[2][0]) == 5 < MAX_TOKENS[2]
    got = {i: (answer, kept) for i, answer, kept in
           greedy_many(runner, PROMPTS, MAX_TOKENS, eos_ids, lambda logits: logits.clone(), slots=slots)}
    assert sorted(got) == list(range(len(PROMPTS)))
    for i, (answer, kept) in enumerate(reference):
        assert got[i][0] == answer
        assert len(got[i][1]) == len(kept) and all(torch.equal(g, w) for g, w in zip(got[i][1], kept))


def test_a_slot_past_its_context_is_a_clear_error(runner):
    batch = Q4Batch(runner, slots=2, n_ctx=8)
    batch.feed({0: PROMPT[:6], 1: PROMPT[:2]})
    with pytest.raises(ContextTooLong):
        batch.feed({0: PROMPT[:3]})
    batch.reset(0)
    assert batch.feed({0: PROMPT[:8]})[0].shape == (runner.vocab_size,)


def test_the_target_cache_filled_in_slots_holds_the_one_at_a_time_samples(runner, tmp_path):
    settings = DecodeSettings(max_new_tokens=10, top_k=8)
    together = serving_samples(TargetCache(tmp_path / "a", "fp"), runner, PROMPTS, settings, {EOS}, slots=4)
    one_by_one = serving_samples(TargetCache(tmp_path / "b", "fp"), runner, PROMPTS, settings, {EOS}, slots=1)
    for x, y in zip(together, one_by_one):
        assert x.prompt_ids == y.prompt_ids and x.response_ids == y.response_ids
        assert torch.equal(x.target.ids, y.target.ids) and torch.equal(x.target.probs, y.target.probs)
