"""Whole GGUFs of the kernel's other matrix types on the osd runner (models/q4_runner.py): a tiny seeded Qwen2 written
by llama.cpp at each file type, its logits against the torch twin holding exactly the dequantized weights.
"""
from __future__ import annotations

import pytest
from conftest import require_module, require_q4
import torch

require_module("llama_cpp")  # the tiny GGUFs are quantized by llama.cpp, as the real files were

from osd.models.q4_runner import Q4Runner  # noqa: E402
from tests.models.test_q4_runner import spread_errors  # noqa: E402
from tests.models.tiny_gguf import (PROMPT, ROW_TOKENS, VOCAB, assert_argmax_agrees_where_clear,  # noqa: E402
                                    assert_rows_match_one_at_a_time, logits_one_at_a_time, write_tiny_gguf)

require_q4()

# file type -> (matrix types the runner should hold, max and mean error bounds as fractions of the logits' spread)
FILES = {"Q8_0": ({"Q8_0"}, 0.05, 0.01)}


@pytest.fixture(scope="module", params=list(FILES))
def typed(request, tmp_path_factory):
    """(file type, runner, reference): a tiny Qwen2 GGUF of that type, the osd runner on it, its dequantized twin."""
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    reference = write_tiny_gguf(path, seed=0, ftype=request.param)
    return request.param, Q4Runner(path, n_ctx=256), reference


def test_the_file_runs_on_its_own_types(typed):
    ftype, runner, _ = typed
    held = {w.TYPE for layer in runner.layers for f in (layer.qkv, layer.attn_output, layer.gate_up, layer.ffn_down)
            for w in f.weights}
    assert held == FILES[ftype][0]  # the file's own blocks: nothing converted to another type


def test_logits_match_the_dequantized_reference(typed):
    ftype, runner, reference = typed
    runner.reset()
    got = runner.feed(PROMPT, n_logits=len(PROMPT))
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0]
    assert got.shape == want.shape == (len(PROMPT), VOCAB)
    worst, mean = spread_errors(got, want)
    _, max_worst, max_mean = FILES[ftype]
    assert worst < max_worst and mean < max_mean, (ftype, worst, mean)
    assert_argmax_agrees_where_clear(got, want, 2 * worst * want.std())


def test_rows_are_bitwise_independent_of_the_row_count(typed):
    _, runner, _ = typed
    start = len(PROMPT)
    assert_rows_match_one_at_a_time(runner, ROW_TOKENS, start, logits_one_at_a_time(runner, ROW_TOKENS, start))
