"""The llama.cpp target backend against a reference computation of the same (quantized) weights.

A tiny seeded Qwen2 is written as a Q4_K/Q6_K GGUF; its torch twin holds the exact dequantized weights.
"""
from __future__ import annotations

import sys

import pytest
from conftest import require_module
import torch

require_module("llama_cpp")

from osd.config import SamplingConfig, SpeculationConfig  # noqa: E402
from osd.engine import SpeculativeEngine  # noqa: E402
from osd.errors import BackendUnavailable  # noqa: E402
from osd.models.llama_cpp_runner import LlamaCppRunner  # noqa: E402
from osd.propose.ngram import NgramProposer  # noqa: E402
from tests.models.tiny_gguf import (PROMPT, VOCAB, ByteTokenizer, ROW_TOKENS, assert_argmax_agrees_where_clear,
                                    assert_rows_match_one_at_a_time,  # noqa: E402,F401
                                    logits_one_at_a_time, speculative_runs, target_only, tiny, tiny_torch_model)

@pytest.fixture(scope="module", params=[True, False], ids=["repack", "no-repack"])
def runner(tiny, request):
    return LlamaCppRunner(tiny[0], n_ctx=256, threads=2, repack=request.param)


def test_logits_match_the_dequantized_reference_and_greedy_agrees(tiny, runner):
    _, reference = tiny
    runner.reset()
    got = runner.feed(PROMPT, n_logits=len(PROMPT))  # (T, V)
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0]  # (T, V)
    assert got.shape == want.shape == (len(PROMPT), VOCAB)
    # llama.cpp rounds activations to 8 bits for its integer dot products: a small, bounded error
    # (measured: max 5.3%, mean 1.0% of the logits' spread; a wrong layer would be of the order of 100%)
    error = (got - want).abs().max().item()
    assert error < 0.08 * want.std().item(), error
    assert (got - want).abs().mean().item() < 0.02 * want.std().item()
    assert_argmax_agrees_where_clear(got, want, 2 * error)


def test_a_positions_logits_do_not_depend_on_how_many_rows_were_verified_with_it(runner):
    """Greedy identity by construction: bitwise-equal logits for every k the engine may verify, rollback included."""
    tokens = ROW_TOKENS
    start = len(PROMPT)
    one_at_a_time = logits_one_at_a_time(runner, tokens, start)
    assert runner.max_rows in (3, 7)
    assert_rows_match_one_at_a_time(runner, tokens, start, one_at_a_time)
    runner.reset()
    runner.feed(tokens[: start + 3])
    runner.rollback(start - 1)  # a rejected tail removed from llama.cpp's KV cache
    assert torch.equal(runner.feed(tokens[start - 1 : start + 2], n_logits=3)[2], one_at_a_time[2])


@pytest.mark.parametrize("draft_seed", [0, 7])  # seed 0: the target's own twin (long accepted chains); 7: a stranger
def test_speculative_output_equals_target_only_at_every_k(tiny, runner, draft_seed):
    for k, result in speculative_runs(runner, tiny[1] if draft_seed == 0 else tiny_torch_model(draft_seed)):
        if draft_seed == 0:
            assert result.counters.accepted > 0  # chains of accepted tokens were exercised


def test_lookup_proposals_keep_output_identical(runner):
    tokenizer = ByteTokenizer()
    prompt = PROMPT * 3  # repetition gives the lookup matches
    plain = target_only(runner, prompt, 32)
    engine = SpeculativeEngine(runner, tokenizer, NgramProposer(VOCAB), SpeculationConfig(k=6, adaptive=False))
    result = engine.generate(prompt, SamplingConfig(max_new_tokens=32))
    assert result.token_ids == plain
    assert result.counters.proposed > 0


def test_missing_llama_cpp_is_a_clear_error(monkeypatch, tiny):
    import osd.models.llama_cpp_runner as backend

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(BackendUnavailable, match="llama-cpp-python"):
        backend.llama_cpp_lib()
