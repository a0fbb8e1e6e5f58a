"""The osd Q4 backend on each model family of models/architectures.py (qwen2, llama, qwen3, gemma3).

Per family, a tiny seeded transformers model is written as a Q4_K/Q6_K GGUF the way llama.cpp's converter writes it
(tests/models/tiny_arch_gguf.py); the reference is transformers' fp32 forward on exactly the weights the file holds.
Prompts are longer than Gemma's sliding window (8), so the sliding layers' windows, RoPE base and the global layers'
scaled RoPE all show. Then the invariants the engine relies on: a row's logits are bitwise the same fed alone, with
up to 8 others, beside other sequences or as a token-tree node; greedy speculative output is the target's own.
"""
from __future__ import annotations

import pytest
from conftest import require_module, require_q4
import torch

from osd.errors import InvalidArgument
from osd.models.architectures import ARCHITECTURES, architecture, sliding, unpermute_rows
from tests.models.tiny_arch_gguf import (FAMILIES, HEAD_DIM, HEADS, KV_HEADS, WINDOW, Q8KInputs, permute,
                                         write_arch_gguf)
from tests.models.tiny_gguf import (PROMPT, ROW_TOKENS, VOCAB, assert_argmax_agrees_where_clear,
                                    assert_rows_match_one_at_a_time, logits_one_at_a_time, speculative_runs,
                                    tiny_torch_model)

require_q4()

from osd.models.q4_draft import Q4Draft  # noqa: E402
from osd.models.q4_runner import Q4Runner, load_weights, serves  # noqa: E402
from osd.models.slots import Feed, Q4Slots  # noqa: E402

# max and mean |osd - transformers| over ROW_TOKENS' logits, as fractions of the reference logits' std. The osd
# forward rounds each matrix's input to 8 bits per 256-block (Q8_K, as llama.cpp does): against the plain fp32
# reference that is all the difference; against the reference with that rounding emulated (Q8KInputs) what remains
# is float summation order, which now and then flips one rounding (a value within ~1e-4 of a half step) and moves
# the positions after it. Measured here (max / mean):
#            fp32             Q8_K emulated
#   qwen2    0.152 / 0.027    0.054 / 0.0024
#   llama    0.136 / 0.027    0.034 / 0.0004
#   qwen3    0.149 / 0.027    0.000 / 0.0000  (no flip: agreement to float precision)
#   gemma3   0.131 / 0.026    0.109 / 0.0148  (a flip at position 4 moves every later one)
# A wrong convention moves the mean far more (measured, emulated reference): Llama q/k rows left permuted 0.70,
# rope_freqs ignored 0.39; Qwen3 without q/k norms 0.40; Gemma window 7 or 9 instead of 8 0.31 / 0.28, no window
# 0.62, the global RoPE on sliding layers 0.39 (the local one on the global layer 0.056), SiLU for GELU 0.13, no
# embedding scale 0.21, no post-attention norm 1.02, no q norm 0.21, attention scale x1.1 0.076.
FP32_TOLERANCE = (0.25, 0.04)
EMULATED_TOLERANCE = (0.2, 0.03)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(arch, GGUF path, transformers reference, runner) of one family's tiny model."""
    arch = request.param
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    reference = write_arch_gguf(path, arch, seed=0)
    return arch, path, reference, Q4Runner(path, n_ctx=256)


def spread_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    error = (got - want).abs()
    return error.max().item() / want.std().item(), error.mean().item() / want.std().item()


def reference_logits(reference, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([tokens])).logits[0].float()  # (T, V)


def test_the_table_is_chosen_from_the_metadata(family):
    arch, path, _, runner = family
    assert runner.shape.arch == arch and runner.family is ARCHITECTURES[arch] and serves(str(path))
    layer = runner.layers[0]
    assert (layer.q_norm is not None) == (arch in ("qwen3", "gemma3"))
    assert (layer.attn_post_norm is not None) == (layer.ffn_post_norm is not None) == (arch == "gemma3")
    windows = [layer.window for layer in runner.layers]
    assert windows == ([WINDOW] * 5 + [0] if arch == "gemma3" else [0] * len(runner.layers))
    if arch == "gemma3":  # sliding layers: RoPE base 10000 unscaled; the global one: 1e6 over 8 (linear scaling)
        assert runner.layers[0].rope[0] is not runner.layers[5].rope[0] and runner.layers[5].rope[0] is runner.cos
        assert runner.shape.rope_scale == 8.0 and runner.shape.sliding_window == WINDOW
    if arch == "llama":
        assert runner.shape.rope_scale == 1.0  # Llama 3 scaling comes as frequency factors, not a linear factor


def test_logits_match_transformers_on_the_dequantized_weights(family):
    """Over 31 positions (Gemma's window of 8 crossed): every family within tolerance of transformers' forward, plain
    and with the kernel's activation rounding emulated; the greedy token agrees wherever the reference's top two are
    further apart than the error."""
    arch, _, reference, runner = family
    runner.reset()
    got = runner.feed(ROW_TOKENS, n_logits=len(ROW_TOKENS))  # (T, V)
    want = reference_logits(reference, ROW_TOKENS)
    with Q8KInputs(reference):
        emulated = reference_logits(reference, ROW_TOKENS)
    assert got.shape == want.shape == (len(ROW_TOKENS), VOCAB)
    worst, mean = spread_errors(got, want)
    worst_emulated, mean_emulated = spread_errors(got, emulated)
    print(f"{arch}: fp32 max {worst:.4f} mean {mean:.4f}; emulated max {worst_emulated:.4f} mean {mean_emulated:.4f}")
    assert worst < FP32_TOLERANCE[0] and mean < FP32_TOLERANCE[1], (arch, worst, mean)
    assert worst_emulated < EMULATED_TOLERANCE[0] and mean_emulated < EMULATED_TOLERANCE[1], (arch, worst_emulated,
                                                                                          mean_emulated)
    assert_argmax_agrees_where_clear(got, want, 2 * worst * want.std())


def test_llama_cpp_reads_the_file_as_osd_does(family):
    """The file is in llama.cpp's convention (a Llama's permuted q/k rows, Gemma's 1 + w norms, its window and RoPE
    bases): llama.cpp's logits on it agree with osd's as closely as either agrees with transformers. Measured (max /
    mean of the std): qwen2 0.137 / 0.023, llama 0.127 / 0.022, qwen3 0.130 / 0.024, gemma3 0.129 / 0.026; llama.cpp
    against transformers 0.12-0.18 / 0.026-0.028 (it also keeps K, V and the attention weights in fp16)."""
    require_module("llama_cpp")
    from osd.models.llama_cpp_runner import LlamaCppRunner

    arch, path, _, runner = family
    llama = LlamaCppRunner(path, n_ctx=256, threads=1, repack=False)
    try:
        want = llama.feed(ROW_TOKENS, n_logits=len(ROW_TOKENS))
    finally:
        llama.close()
    runner.reset()
    worst, mean = spread_errors(runner.feed(ROW_TOKENS, n_logits=len(ROW_TOKENS)), want)
    assert worst < FP32_TOLERANCE[0] and mean < FP32_TOLERANCE[1], (arch, worst, mean)


def test_the_sliding_window_matters_over_these_prompts(family):
    """Guard on the test itself: with Gemma's window widened to the whole prompt the reference moves far beyond the
    tolerance, so the agreement above checks the window."""
    arch, _, reference, runner = family
    if arch != "gemma3":
        pytest.skip("no sliding window in this family")
    runner.reset()
    got = runner.feed(ROW_TOKENS, n_logits=len(ROW_TOKENS))
    reference.config.sliding_window = 10**6
    try:
        unwindowed = reference_logits(reference, ROW_TOKENS)
    finally:
        reference.config.sliding_window = WINDOW
    assert spread_errors(got, unwindowed)[1] > 5 * FP32_TOLERANCE[1]


def test_a_positions_logits_do_not_depend_on_how_many_rows_were_fed_with_it(family):
    """Bitwise equal logits for the pending token + k = 0..8 proposals (positions 21-30, past the window), and for
    the whole prompt fed at once or in chunks of 4 rows."""
    _, path, _, runner = family
    start = len(PROMPT)
    one_at_a_time = logits_one_at_a_time(runner, ROW_TOKENS, start)
    assert_rows_match_one_at_a_time(runner, ROW_TOKENS, start, one_at_a_time)
    runner.reset()
    whole = runner.feed(ROW_TOKENS, n_logits=len(ROW_TOKENS) - start + 1)
    assert all(torch.equal(whole[i], one_at_a_time[i]) for i in range(len(one_at_a_time)))
    chunked = Q4Runner(path, n_ctx=256, chunk_rows=4)
    assert torch.equal(chunked.feed(ROW_TOKENS, n_logits=len(ROW_TOKENS) - start + 1), whole)


def test_several_sequences_and_a_tree_in_one_pass_are_each_alone(family):
    """Three slots' rows in one forward (chains at different lengths, one of them a token tree) give bitwise the
    logits each gets fed alone; each tree node gets its path's logits fed as a chain."""
    _, _, _, runner = family
    prefixes = [PROMPT[:14], PROMPT[3:], PROMPT[:5] * 2]
    steps = [[65, 66, 67], [68], None]  # slot 2 feeds a tree
    parents, nodes = [-1, -1, 0, 0, 1, 2, 2, 5], [70, 71, 72, 73, 74, 75, 76, 77]  # depths up to 4: the window slides
    slots = Q4Slots(runner, 3, exclusive=True)
    slots.feed([Feed(j, p[:-1], 0) for j, p in enumerate(prefixes)])
    got = slots.feed([Feed(0, [prefixes[0][-1]] + steps[0], 4), Feed(1, [prefixes[1][-1]] + steps[1], 2),
                      Feed(2, [prefixes[2][-1]] + nodes, 1 + len(nodes), tree=parents)])
    for j in (0, 1):
        runner.reset()
        runner.feed(prefixes[j][:-1], n_logits=0)
        assert torch.equal(got[j], runner.feed([prefixes[j][-1]] + steps[j], n_logits=len(steps[j]) + 1))
    for node in range(len(nodes)):
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        runner.reset()
        runner.feed(prefixes[2][:-1], n_logits=0)
        chain = runner.feed([prefixes[2][-1]] + [nodes[i] for i in path], n_logits=len(path) + 1)
        assert torch.equal(got[2][1 + node], chain[-1]) and torch.equal(got[2][0], chain[0]), node


def test_greedy_speculative_output_is_the_targets_own_at_every_k(family):
    """k = 1..8 with the file's own Q4 copy drafting (every proposal accepted: long chains, batched drafting on the
    same forward) and with a stranger (a tiny Qwen2 in torch: rejections): always the target-only tokens."""
    _, path, _, runner = family
    for _, result in speculative_runs(runner, Q4Draft(load_weights(path))):
        assert result.counters.accepted > 0  # the target's own weights propose: long accepted chains
    for _, result in speculative_runs(runner, tiny_torch_model(7)):
        assert result.counters.accepted < result.counters.proposed  # rejections exercised


# ------------------------------------------------------------------------------------------ the table itself
def test_unpermute_rows_undoes_the_converters_permutation():
    for heads in (HEADS, KV_HEADS):
        w = torch.randn(heads * HEAD_DIM, 8)
        assert torch.equal(permute(w, heads)[unpermute_rows(heads * HEAD_DIM, heads)], w)
    with pytest.raises(InvalidArgument, match="heads"):
        unpermute_rows(10, 4)


def test_the_table_says_what_each_family_needs():
    assert [ARCHITECTURES[a].rope for a in ("qwen2", "llama", "qwen3", "gemma3")] == ["neox", "normal", "neox", "neox"]
    gemma = architecture("gemma3")
    assert gemma.activation == "gelu_tanh" and gemma.embed_scale and gemma.post_norms and gemma.qk_norm
    assert [sliding(gemma, i) for i in range(12)] == [True] * 5 + [False] + [True] * 5 + [False]
    assert not any(sliding(architecture("llama"), i) for i in range(12))
    assert architecture("qwen2").qkv_bias and not architecture("qwen3").qkv_bias and architecture("qwen3").qk_norm


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "mistral3"])
def test_an_unsupported_architecture_names_itself_and_the_fallback(tmp_path, arch):
    import gguf

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 256).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidArgument, match=rf"runs qwen2, llama, qwen3, gemma3 GGUFs; this one is '{arch}' "
                                              r"\(served on llama\.cpp instead"):
        Q4Runner(path)
    assert not serves(str(path))


def test_a_tensor_the_forward_would_drop_is_refused(tmp_path):
    """A Llama file with an output-projection bias (llama.cpp reads it; this forward has no place for it)."""
    path = tmp_path / "llama-bias.gguf"
    write_arch_gguf(path, "llama", seed=1, extra={"blk.0.attn_output.bias": torch.zeros(256).numpy()})
    with pytest.raises(InvalidArgument, match=r"does not compute with \(blk\.0\.attn_output\.bias"):
        Q4Runner(path)
    assert not serves(str(path))


# ------------------------------------------------------------------------------------------ the glue's new steps
def test_glue_gelu_head_norms_window_and_scale_match_torch_math():
    import torch.nn.functional as F

    from osd.models.q4_runner import glue

    g = glue()
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(3, 2 * 64, generator=gen) * 4
    want = F.gelu(gate_up[:, :64], approximate="tanh") * gate_up[:, 64:]
    torch.testing.assert_close(g.gelu_mul(gate_up), want, rtol=1e-5, atol=1e-5)
    # per-head RMSNorm of q and k before RoPE; attention within a window of 5 at scale 0.3, all positions of a cache
    H, G, D, T = 4, 2, 16, 12
    cos, sin = torch.randn(T, D // 2, generator=gen), torch.randn(T, D // 2, generator=gen)
    qkv, bias = torch.randn(T, (H + 2 * G) * D, generator=gen), torch.randn((H + 2 * G) * D, generator=gen)
    q_norm, k_norm = torch.randn(D, generator=gen), torch.randn(D, generator=gen)
    k_cache, v_cache = torch.zeros(G, T, D), torch.zeros(G, T, D)
    pos = torch.arange(T)
    q = g.qkv_rope(qkv, bias, cos, sin, pos, k_cache, v_cache, H, q_norm, k_norm, 1e-6)

    def rope(t):  # (T, heads, D), NEOX pairs (i, i + D/2)
        c, s = cos[pos][:, None], sin[pos][:, None]
        a, b = t[..., : D // 2], t[..., D // 2 :]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    parts = (qkv + bias).split([H * D, G * D, G * D], dim=1)
    torch.testing.assert_close(q, rope(norm(parts[0].reshape(T, H, D), q_norm)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache.transpose(0, 1), rope(norm(parts[1].reshape(T, G, D), k_norm)), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(v_cache.transpose(0, 1), parts[2].reshape(T, G, D))
    out = g.attention(q, k_cache, v_cache, pos, 0.3, 5)  # (T, H D)
    keys, values = k_cache.repeat_interleave(H // G, dim=0), v_cache.repeat_interleave(H // G, dim=0)  # (H, T, D)
    scores = torch.einsum("mhd,htd->mht", q, keys) * 0.3
    t, p = torch.arange(T)[None, None, :], pos[:, None, None]
    scores = scores.masked_fill((t > p) | (t <= p - 5), float("-inf"))
    want = torch.einsum("mht,htd->mhd", scores.softmax(-1), values).reshape(T, H * D)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, g.attention(q, k_cache, v_cache, pos, 0.3, 0))  # the window changed something
    for m in range(T):  # a row alone gives bitwise its row of the batch
        assert torch.equal(g.attention(q[m : m + 1].contiguous(), k_cache, v_cache, pos[m : m + 1], 0.3, 5), out[m : m + 1])
