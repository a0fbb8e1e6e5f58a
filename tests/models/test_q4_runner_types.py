"""Whole GGUFs of the kernel's other matrix types on the osd runner (models/q4_runner.py): a tiny seeded Qwen2 written
by llama.cpp at each file type, its logits against the torch twin holding exactly the dequantized weights.
"""
from __future__ import annotations

import pytest
from conftest import require_module, require_q4
import torch

require_module("llama_cpp")  # the tiny GGUFs are quantized by llama.cpp, as the real files were

from osd.errors import InvalidArgument  # noqa: E402
from osd.models import q4  # noqa: E402
from osd.models.q4_runner import Q4Runner, serves  # noqa: E402
from tests.models.test_q4_runner import spread_errors  # noqa: E402
from tests.models.tiny_gguf import (PROMPT, ROW_TOKENS, VOCAB, assert_argmax_agrees_where_clear,  # noqa: E402
                                    assert_rows_match_one_at_a_time, logits_one_at_a_time, write_tiny_gguf)

require_q4()

# llama.cpp file type -> (the matrix types it writes: llama.cpp keeps the LM head Q6_K and Q5_K_M some attn_v /
# ffn_down Q6_K; max and mean error bounds, as fractions of the logits' spread). Measured vs the fp32 reference:
# 3.1/0.7% Q8_0, 4.6/1.0% Q4_0, 5.3/0.9% Q4_1, 6.0/1.1% Q5_K_M, 4.1/0.9% Q5_0, 4.4/0.9% Q5_1; vs llama.cpp on the file:
# 4.1/0.9%, 5.5/1.2%, 4.6/1.0%, 5.6/1.1%, 5.9/1.1%, 4.8/1.0%. llama.cpp itself is 4.1-4.8% max from the reference:
# activations rounded to 8 bits, as both do, are most of it.
FILES = {"Q8_0": ({"Q8_0"}, 0.05, 0.012), "Q4_0": ({"Q4_0", "Q6_K"}, 0.07, 0.015),
         "Q4_1": ({"Q4_1", "Q6_K"}, 0.08, 0.015), "Q5_K_M": ({"Q5_K", "Q6_K"}, 0.09, 0.016),
         "Q5_0": ({"Q5_0", "Q6_K"}, 0.09, 0.016), "Q5_1": ({"Q5_1", "Q6_K"}, 0.09, 0.016)}


@pytest.fixture(scope="module", params=list(FILES))
def typed(request, tmp_path_factory):
    """(file type, runner, reference): a tiny Qwen2 GGUF of that type, the osd runner on it, its dequantized twin."""
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    reference = write_tiny_gguf(path, seed=0, ftype=request.param)
    return request.param, Q4Runner(path, n_ctx=256), reference


def test_the_file_runs_on_its_own_types(typed):
    ftype, runner, _ = typed
    fused = [f for layer in runner.layers for f in (layer.qkv, layer.attn_output, layer.gate_up, layer.ffn_down)]
    held = {w.TYPE for f in fused + [runner.head] for w in f.weights}
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


def test_logits_match_llama_cpp_on_the_same_file(typed):
    from osd.models.llama_cpp_runner import LlamaCppRunner

    ftype, runner, _ = typed
    llama = LlamaCppRunner(runner.path, n_ctx=256, threads=2, repack=False)
    runner.reset()
    got = runner.feed(PROMPT, n_logits=len(PROMPT))
    want = llama.feed(PROMPT, n_logits=len(PROMPT))
    llama.close()
    worst, mean = spread_errors(got, want)
    _, max_worst, max_mean = FILES[ftype]
    assert worst < max_worst and mean < max_mean, (ftype, worst, mean)
    assert_argmax_agrees_where_clear(got, want, 2 * worst * want.std())


def test_rows_are_bitwise_independent_of_the_row_count(typed):
    _, runner, _ = typed
    start = len(PROMPT)
    assert_rows_match_one_at_a_time(runner, ROW_TOKENS, start, logits_one_at_a_time(runner, ROW_TOKENS, start))


def test_the_avx2_path_gives_bitwise_the_same_logits(typed, monkeypatch):
    """OSD_Q4_ISA=avx2 (what an AVX2-only CPU runs) against the AVX-512 VNNI path of the same file."""
    if not q4.has_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI")
    _, runner, _ = typed
    monkeypatch.setenv("OSD_Q4_ISA", "avx2")
    avx2 = Q4Runner(runner.path, n_ctx=256)
    runner.reset()
    assert torch.equal(avx2.feed(PROMPT, n_logits=5), runner.feed(PROMPT, n_logits=5))


@pytest.mark.parametrize("ftype,kind", [("Q3_K_M", "Q3_K"), ("IQ4_XS", "IQ4_XS")])
def test_a_type_the_kernel_does_not_run_is_an_error_naming_it_and_llama_cpp(tmp_path, ftype, kind):
    """Not converted to a type it runs: an error naming the type and llama.cpp, and `auto` serves the file there."""
    from osd.build import target_backend
    from osd.config import ModelConfig

    path = tmp_path / f"tiny-{ftype}.gguf"
    write_tiny_gguf(path, seed=0, ftype=ftype)
    with pytest.raises(InvalidArgument, match=rf"is {kind}: the osd kernel runs .*not {kind} .*--target-backend llama\.cpp"):
        Q4Runner(path, n_ctx=64)
    assert not serves(str(path)) and target_backend(ModelConfig(target=str(path))) == "llama.cpp"


def test_a_width_not_a_multiple_of_256_runs_padded(tmp_path, monkeypatch):
    """A Q8_0 file of hidden width 384 (as the Qwen2.5 0.5B's 896: whole 32-weight blocks, not whole 256-blocks): its
    matrices are padded with zero blocks, the activations with zero columns, and it runs as the others do."""
    from tests.models import tiny_gguf

    monkeypatch.setattr(tiny_gguf, "HIDDEN", 384)  # head dim 96
    path = tmp_path / "tiny-384-q8_0.gguf"
    reference = write_tiny_gguf(path, seed=0, ftype="Q8_0")
    runner = Q4Runner(path, n_ctx=256)
    assert runner.shape.hidden == 384 and runner.layers[0].qkv.weights[0].shape[1] == 512
    got = runner.feed(PROMPT, n_logits=len(PROMPT))
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0]
    worst, mean = spread_errors(got, want)
    _, max_worst, max_mean = FILES["Q8_0"]
    assert worst < max_worst and mean < max_mean, (worst, mean)
    start = len(PROMPT)
    assert_rows_match_one_at_a_time(runner, ROW_TOKENS, start, logits_one_at_a_time(runner, ROW_TOKENS, start))
