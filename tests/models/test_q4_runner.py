"""The osd Q4 target backend (models/q4_runner.py) against references of the same quantized weights.

A tiny seeded Qwen2 is written as a Q4_K_M GGUF by llama.cpp itself; its torch twin holds the exact dequantized
weights (tests/models/tiny_gguf.py). References: the twin in fp32, llama.cpp on the same file, torch's own math
for each glue function.
"""
from __future__ import annotations

import pytest
from conftest import require_module, require_q4
import torch
import torch.nn.functional as F

require_module("llama_cpp")  # the tiny GGUF is quantized by llama.cpp, as the real files were

from osd.build import DEFAULT_DRAFT, System, build_target, speculative_engine  # noqa: E402
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig  # noqa: E402
from osd.drafts import DraftRegistry  # noqa: E402
from osd.errors import InvalidArgument  # noqa: E402
from osd.models import q4  # noqa: E402
from osd.models.q4_runner import Q4Runner, cache_path, fused_groups, glue  # noqa: E402
from osd.propose import DraftModelProposer  # noqa: E402
from osd.propose.ngram import LookupThenDraft  # noqa: E402
from tests.models.tiny_gguf import (EOS, PROMPT, VOCAB, ByteTokenizer, ROW_TOKENS, assert_argmax_agrees_where_clear,
                                    assert_rows_match_one_at_a_time,  # noqa: E402,F401
                                    logits_one_at_a_time, speculative_runs, target_only, tiny, tiny_torch_model,
                                    write_tiny_gguf)  # (tiny: a fixture)

require_q4()

@pytest.fixture(scope="module")
def runner(tiny):
    return Q4Runner(tiny[0], n_ctx=256)


def spread_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """Max and mean absolute error as fractions of the reference logits' spread (std)."""
    error = (got - want).abs()
    return error.max().item() / want.std().item(), error.mean().item() / want.std().item()


def test_the_tiny_file_mixes_q4k_and_q6k_and_runs_fused(runner):
    assert runner.vocab_size == VOCAB and runner.eos_ids == {EOS} and runner.context_window == 256
    types = {type(w).__name__ for layer in runner.layers for w in layer.qkv.weights + layer.ffn_down.weights}
    assert types == {"Q4KWeight", "Q6KWeight"}  # llama.cpp's Q4_K_M gives some layers Q6_K v / down
    assert all(len(layer.gate_up.weights) == 1 for layer in runner.layers)  # gate|up: one kernel call
    assert len(runner.layers[0].qkv.weights) == 1  # q|k|v all Q4_K in layer 0: one call
    assert fused_groups(["Q4_K", "Q4_K", "Q6_K"]) == [(0, 2), (2, 3)]


def test_logits_match_the_dequantized_reference_and_greedy_agrees(tiny, runner):
    _, reference = tiny
    runner.reset()
    got = runner.feed(PROMPT, n_logits=len(PROMPT))  # (T, V)
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0]  # (T, V)
    assert got.shape == want.shape == (len(PROMPT), VOCAB)
    # activations are rounded to 8 bits per 256-block for the integer dot products (as llama.cpp does): a small,
    # bounded error (measured: max 5.2%, mean 1.0% of the logits' spread; a wrong layer is of the order of 100%)
    worst, mean = spread_errors(got, want)
    assert worst < 0.08 and mean < 0.02, (worst, mean)
    assert_argmax_agrees_where_clear(got, want, 2 * worst * want.std())


def test_logits_match_llama_cpp_on_the_same_file(tiny, runner):
    from osd.models.llama_cpp_runner import LlamaCppRunner

    llama = LlamaCppRunner(tiny[0], n_ctx=256, threads=2, repack=False)
    runner.reset()
    got = runner.feed(PROMPT, n_logits=len(PROMPT))
    want = llama.feed(PROMPT, n_logits=len(PROMPT))
    llama.close()
    # the same Q4_K/Q6_K x Q8_K products; llama.cpp also rounds K, V, q and the attention weights to fp16 where we keep
    # fp32, and each rounding can flip an int8 rounding downstream (measured: max 5.8%, mean 1.1% of the spread)
    worst, mean = spread_errors(got, want)
    assert worst < 0.08 and mean < 0.02, (worst, mean)
    assert_argmax_agrees_where_clear(got, want, 2 * worst * want.std())


def test_a_positions_logits_do_not_depend_on_how_many_rows_were_fed_with_it(runner):
    """Greedy identity by construction: bitwise-equal logits for every k = 0..8, rollback included."""
    tokens = ROW_TOKENS
    start = len(PROMPT)
    one_at_a_time = logits_one_at_a_time(runner, tokens, start)
    assert runner.max_rows == 9
    assert_rows_match_one_at_a_time(runner, tokens, start, one_at_a_time)
    runner.reset()
    runner.feed(tokens[: start + 5])
    runner.rollback(start - 1)  # a rejected tail: its cache rows are overwritten by the next feed
    assert torch.equal(runner.feed([tokens[start - 1], 7, 7], n_logits=3)[0], one_at_a_time[0])
    runner.rollback(start)
    assert torch.equal(runner.feed(tokens[start : start + 2], n_logits=2)[1], one_at_a_time[2])
    runner.reset()  # the prompt path: the whole sequence in one feed, and in chunks of 4 rows
    whole = runner.feed(tokens, n_logits=len(tokens) - start + 1)
    assert all(torch.equal(whole[i], one_at_a_time[i]) for i in range(len(one_at_a_time)))
    chunked = Q4Runner(runner.path, n_ctx=256, chunk_rows=4)
    assert torch.equal(chunked.feed(tokens, n_logits=len(tokens) - start + 1), whole)


@pytest.mark.parametrize("draft_seed", [0, 7])  # seed 0: the target's own twin (long accepted chains); 7: a stranger
def test_speculative_output_equals_target_only_at_every_k(tiny, runner, draft_seed):
    assert runner.max_rows == 9  # so every k up to 8 is verified in one feed (speculative_runs checks it)
    for k, result in speculative_runs(runner, tiny[1] if draft_seed == 0 else tiny_torch_model(draft_seed)):
        if draft_seed == 0:
            assert result.counters.accepted > 0  # chains of accepted tokens were exercised
        else:
            assert result.counters.accepted < result.counters.proposed  # rejections were exercised


def test_speculative_engine_gives_another_target_a_proposer_of_the_systems_kind(tiny, runner):
    """What `osd bench speed` builds for its osd_q4 arm: the system's published draft, behind its own lookup."""
    registry = DraftRegistry()
    registry.publish(DEFAULT_DRAFT, tiny[1])
    spec = SpeculationConfig(k=4, adaptive=False, lookup=True)
    system = System(None, ByteTokenizer(), registry, runner, tiny[1], ModelConfig(), spec)
    engine = speculative_engine(system, runner, spec)
    assert isinstance(engine.proposer, LookupThenDraft) and isinstance(engine.proposer.draft, DraftModelProposer)
    assert engine.proposer.draft.name == DEFAULT_DRAFT and len(engine.request_observers) == 1
    result = engine.generate(PROMPT, SamplingConfig(max_new_tokens=16))
    assert result.token_ids == target_only(runner, PROMPT, 16) and result.counters.accepted > 0
    system.draft_master = None  # no draft: the lookup alone
    assert speculative_engine(system, runner, spec).proposer.draft is None


def test_repacked_weights_cache_round_trip(tiny, runner, tmp_path):
    first = Q4Runner(tiny[0], n_ctx=256, cache=True, cache_dir=tmp_path)
    stored = cache_path(tiny[0], tmp_path)
    assert stored.exists()
    again = Q4Runner(tiny[0], n_ctx=256, cache=True, cache_dir=tmp_path)  # loaded from the cache (mapped)
    read = Q4Runner(tiny[0], n_ctx=256, cache=True, cache_dir=tmp_path, mmap=False)  # ... or read into memory
    runner.reset()
    want = runner.feed(PROMPT, n_logits=3)
    assert torch.equal(first.feed(PROMPT, n_logits=3), want)
    assert torch.equal(again.feed(PROMPT, n_logits=3), want)
    assert torch.equal(read.feed(PROMPT, n_logits=3), want)


def test_glue_functions_match_torch_math():
    g = glue()
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 256, generator=gen), torch.randn(256, generator=gen)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(g.rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(3, 2 * 64, generator=gen) * 4
    torch.testing.assert_close(g.silu_mul(gate_up), F.silu(gate_up[:, :64]) * gate_up[:, 64:], rtol=1e-5, atol=1e-6)
    # RoPE + cache write + causal GQA attention: 4 heads over 2 KV heads, rows at positions 3..6 of a cache of 8
    H, G, D, T = 4, 2, 16, 8
    cos, sin = torch.randn(T, D // 2, generator=gen), torch.randn(T, D // 2, generator=gen)
    qkv, bias = torch.randn(4, (H + 2 * G) * D, generator=gen), torch.randn((H + 2 * G) * D, generator=gen)
    k_cache, v_cache = torch.randn(G, T, D, generator=gen), torch.randn(G, T, D, generator=gen)
    pos = torch.arange(3, 7)
    k_before = k_cache.clone()
    q = g.qkv_rope(qkv, bias, cos, sin, pos, k_cache, v_cache, H)

    def rope(t):  # (M, heads, D), NEOX pairs (i, i + D/2)
        c, s = cos[pos][:, None], sin[pos][:, None]
        a, b = t[..., : D // 2], t[..., D // 2 :]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    parts = (qkv + bias).split([H * D, G * D, G * D], dim=1)
    torch.testing.assert_close(q, rope(parts[0].reshape(4, H, D)))
    torch.testing.assert_close(k_cache[:, 3:7].transpose(0, 1), rope(parts[1].reshape(4, G, D)))
    torch.testing.assert_close(v_cache[:, 3:7].transpose(0, 1), parts[2].reshape(4, G, D))
    assert torch.equal(k_cache[:, :3], k_before[:, :3]) and torch.equal(k_cache[:, 7:], k_before[:, 7:])
    out = g.attention(q, k_cache, v_cache, pos)  # (M, H D)
    keys, values = k_cache.repeat_interleave(H // G, dim=0), v_cache.repeat_interleave(H // G, dim=0)  # (H, T, D)
    scores = torch.einsum("mhd,htd->mht", q, keys) / D**0.5
    scores = scores.masked_fill(torch.arange(T)[None, None, :] > pos[:, None, None], float("-inf"))
    want = torch.einsum("mht,htd->mhd", scores.softmax(-1), values).reshape(4, H * D)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for m in range(4):  # a row alone gives bitwise its row of the batch
        assert torch.equal(g.attention(q[m : m + 1].contiguous(), k_cache, v_cache, pos[m : m + 1]), out[m : m + 1])


@pytest.mark.parametrize("T", [31, 32, 33, 100])  # around and past the glue's chunk of keys (KEY_CHUNK = 32)
def test_glue_attention_over_long_caches_is_each_head_alone(T):
    """The query heads of a KV head are computed together, a chunk of keys at a time for all of them: each head's
    output is bitwise that head computed alone (a query tensor with one head per KV head), and the whole is
    attention within float tolerance, for caches that end inside, at and beyond a chunk."""
    g = glue()
    gen = torch.Generator().manual_seed(T)
    H, G, D, M = 6, 2, 16, 3
    q = torch.randn(M, H, D, generator=gen)
    k_cache, v_cache = torch.randn(G, T, D, generator=gen), torch.randn(G, T, D, generator=gen)
    pos = torch.tensor([T - 3, T - 2, T - 1])
    out = g.attention(q, k_cache, v_cache, pos).reshape(M, H, D)
    for i in range(H // G):  # head i of every group, alone: a query of one head per KV head
        heads = [j * (H // G) + i for j in range(G)]
        alone = g.attention(q[:, heads].contiguous(), k_cache, v_cache, pos).reshape(M, G, D)
        assert torch.equal(alone, out[:, heads])
    keys, values = k_cache.repeat_interleave(H // G, dim=0), v_cache.repeat_interleave(H // G, dim=0)
    scores = torch.einsum("mhd,htd->mht", q, keys) / D**0.5
    scores = scores.masked_fill(torch.arange(T)[None, None, :] > pos[:, None, None], float("-inf"))
    want = torch.einsum("mht,htd->mhd", scores.softmax(-1), values)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_the_osd_backend_is_built_from_the_config(tiny):
    target = build_target(ModelConfig(target=str(tiny[0]), target_backend="osd", n_ctx=128))
    assert isinstance(target, Q4Runner) and target.context_window == 128
    with pytest.raises(InvalidArgument, match="GGUF"):
        build_target(ModelConfig(target="some/hf-model", target_backend="osd"))
    with pytest.raises(InvalidArgument, match="target_backend"):
        ModelConfig(target_backend="q5")


def test_an_unsupported_architecture_is_a_clear_error(tmp_path):
    import gguf

    path = tmp_path / "phi3.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 256).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidArgument, match="runs qwen2, llama, qwen3, gemma3 GGUFs; this one is 'phi3'"):
        Q4Runner(path)


def test_an_unsupported_weight_type_is_a_clear_error(tmp_path):
    path = tmp_path / "tiny-f32.gguf"
    write_tiny_gguf(path, seed=1, quantize=False)
    with pytest.raises(InvalidArgument, match=r"blk\.0\.attn_q\.weight is F32: the osd kernel runs Q4_K, .*not F32.*llama\.cpp"):
        Q4Runner(path)


def test_auto_serves_a_gguf_on_the_q4_kernel_where_it_runs_the_file_else_on_llama_cpp(tiny, tmp_path):
    from osd.build import target_backend
    from osd.models.q4_runner import serves

    assert serves(str(tiny[0])) and target_backend(ModelConfig(target=str(tiny[0]))) == "osd"
    assert isinstance(build_target(ModelConfig(target=str(tiny[0]), n_ctx=64)), Q4Runner)
    f32 = tmp_path / "tiny-f32.gguf"  # a Qwen2 file whose matrices the kernel does not run
    write_tiny_gguf(f32, seed=1, quantize=False)
    assert not serves(str(f32)) and target_backend(ModelConfig(target=str(f32))) == "llama.cpp"
    assert not serves(str(tmp_path / "missing.gguf"))
    assert target_backend(ModelConfig(target=str(tiny[0]), target_backend="llama.cpp")) == "llama.cpp"  # asked for
    assert target_backend(ModelConfig(target=str(tiny[0])), target_model=object()) == "torch"  # a given torch model
