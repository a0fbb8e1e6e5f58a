"""Greedy identity by construction: a row's result does not depend on how many rows are computed with it.

On the real compiled kernels (skipped only where they cannot be built): rows_linear, rows_linear_int8,
attention_rows and silu_rows bitwise for k = 0..8 (1..9 rows) and a prefill-sized block, and through whole
models (CachedModel over a prepacked target and an int8 serving draft). Plus the loud failure: without the
kernels, KernelUnavailable unless a fallback is allowed, and then kernels.status() says so.
"""
import pytest
import torch
from conftest import VOCAB, tiny_qwen2

from osd.errors import KernelUnavailable
from osd.models import kernels
from osd.models.cached import CachedModel
from osd.models.prepack import FastLinear, prepack_linears, shared_weights_copy
from osd.models.serving_draft import Int8Linear, make_serving_draft

KS = range(0, 9)  # proposal lengths: a verification step feeds k + 1 rows


def windows(total: int):
    """(start, rows) for every k in KS and every start where k + 1 rows fit in `total`."""
    return [(start, k + 1) for k in KS for start in range(total - k)]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_features,out_features", [(64, 40), (37, 5), (901, 333), (1536, 9)])
def test_linears_give_each_row_the_same_bits_whatever_the_row_count(compiled, in_features, out_features, bias):
    torch.manual_seed(0)
    x = torch.randn(12, in_features)
    w, b = torch.randn(out_features, in_features), torch.randn(out_features) if bias else None
    w8, scale = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8), torch.rand(out_features)
    alone = torch.cat([compiled.rows_linear(x[i : i + 1], w, b) for i in range(12)])  # each row computed alone
    alone8 = torch.cat([compiled.rows_linear_int8(x[i : i + 1], w8, scale, b) for i in range(12)])
    for start, rows in windows(12):
        assert torch.equal(compiled.rows_linear(x[start : start + rows], w, b), alone[start : start + rows]), (start, rows)
        assert torch.equal(compiled.rows_linear_int8(x[start : start + rows], w8, scale, b), alone8[start : start + rows])
    # and they compute the right thing (up to float rounding)
    reference = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(alone.double(), reference, rtol=1e-5, atol=1e-4)
    reference8 = torch.nn.functional.linear(x.double(), w8.double() * scale.double()[:, None], None if b is None else b.double())
    torch.testing.assert_close(alone8.double(), reference8, rtol=1e-5, atol=1e-3)


def test_a_prefill_block_and_any_thread_count_give_the_same_bits(compiled):
    torch.manual_seed(1)
    x, w = torch.randn(70, 300), torch.randn(200, 300)  # 70 rows: several row blocks and column panels
    w8, scale = torch.randint(-127, 128, (200, 300), dtype=torch.int8), torch.rand(200)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([compiled.rows_linear(x[i : i + 1], w) for i in range(70)])
        alone8 = torch.cat([compiled.rows_linear_int8(x[i : i + 1], w8, scale) for i in range(70)])
        torch.set_num_threads(3)  # columns split differently across threads
        assert torch.equal(compiled.rows_linear(x, w), alone)
        assert torch.equal(compiled.rows_linear_int8(x, w8, scale), alone8)
    finally:
        torch.set_num_threads(threads)


def test_attention_rows_is_causal_attention_and_row_invariant(compiled):
    torch.manual_seed(2)
    heads, kv_heads, dim, length = 6, 2, 20, 45  # grouped queries; a head size that is no multiple of 8
    q, k, v = torch.randn(heads, 9, dim), torch.randn(kv_heads, length, dim), torch.randn(kv_heads, length, dim)
    scale = dim**-0.5
    full = compiled.attention_rows(q, k, v, scale)  # (9, H, D): queries at positions length-9 .. length-1
    mask = torch.ones(9, length, dtype=torch.bool).tril(length - 9)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(3, 0), v.double().repeat_interleave(3, 0), attn_mask=mask, scale=scale)
    torch.testing.assert_close(full.double(), reference.transpose(0, 1), rtol=1e-5, atol=1e-6)
    for t in range(9):  # each query alone, over exactly the keys it sees, as a 1-row decoding step computes it
        seen = length - 9 + t + 1
        assert torch.equal(compiled.attention_rows(q[:, t : t + 1], k[:, :seen], v[:, :seen], scale)[0], full[t])
    for start, rows in windows(9):  # and k + 1 queries together, over the keys the last of them sees
        seen = length - 9 + start + rows
        assert torch.equal(compiled.attention_rows(q[:, start : start + rows], k[:, :seen], v[:, :seen], scale),
                           full[start : start + rows])


def test_silu_rows_is_silu_with_the_same_bits_at_any_size(compiled):
    torch.manual_seed(3)
    x = torch.randn(1003) * 6
    y = compiled.silu_rows(x)
    torch.testing.assert_close(y.double(), torch.nn.functional.silu(x.double()), rtol=2e-6, atol=1e-6)
    for n in (1, 5, 8, 9, 17):
        for start in (0, 3, 500):
            assert torch.equal(compiled.silu_rows(x[start : start + n]), y[start : start + n])


def mid_qwen2():
    """Wider than the tiny model: torch's SiLU would split its 9 x 7000 elements into chunks whose scalar tails
    change values; a head size of 16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(4)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=7000, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2ForCausalLM(config).eval().requires_grad_(False)


def model_logits_invariance(model, context: int, vocab: int):
    """(k, row) pairs where feeding k + 1 rows changed a row's logits from feeding that position alone."""
    tokens = torch.randint(0, vocab, (context + 9,), generator=torch.Generator().manual_seed(context)).tolist()
    runner = CachedModel(model)
    runner.feed(tokens[:context])
    alone = [runner.feed([t])[0] for t in tokens[context:]]  # one row per step, as target-only decoding feeds
    changed = []
    for k in KS:
        runner.rollback(context)
        together = runner.feed(tokens[context : context + k + 1], n_logits=k + 1)  # one verification step
        changed += [(k, i) for i in range(k + 1) if not torch.equal(together[i], alone[i])]
    return changed


@pytest.mark.parametrize("which,context", [("tiny", 1), ("tiny", 6), ("tiny", 40), ("mid", 6)])
def test_prepacked_target_logits_do_not_depend_on_the_rows_verified_with_them(compiled, which, context):
    model, vocab = (tiny_qwen2(seed=0), VOCAB) if which == "tiny" else (mid_qwen2(), 300)
    fast = shared_weights_copy(model)
    prepack_linears(fast)
    assert fast.config._attn_implementation == "osd_rows"
    assert model_logits_invariance(fast, context, vocab) == []


@pytest.mark.parametrize("context", [1, 40])
def test_int8_serving_draft_logits_do_not_depend_on_the_rows_fed_with_them(compiled, context):
    serving, _ = make_serving_draft(tiny_qwen2(seed=1, layers=1), "int8")
    assert any(isinstance(m, Int8Linear) for m in serving.modules())
    assert model_logits_invariance(serving, context, VOCAB) == []


def test_padded_batches_still_go_through_sdpa(compiled):
    """osd distill decodes padded batches with the prepacked target: the compiled attention hands them to sdpa."""
    model = tiny_qwen2(seed=0)
    fast = shared_weights_copy(model)
    prepack_linears(fast)
    ids = torch.tensor([[0, 0, 5, 9, 3], [7, 2, 5, 9, 3]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.inference_mode():
        torch.testing.assert_close(fast(input_ids=ids, attention_mask=mask).logits[:, -1],
                                   model(input_ids=ids, attention_mask=mask).logits[:, -1], rtol=1e-4, atol=1e-4)


@pytest.fixture
def no_kernels(monkeypatch):
    """The kernels as on a machine that cannot build them (OSD_NO_KERNELS), state restored afterwards."""
    monkeypatch.setenv("OSD_NO_KERNELS", "1")
    kernels._reset_for_tests()
    yield
    monkeypatch.delenv("OSD_NO_KERNELS")
    kernels._reset_for_tests()


def test_missing_kernels_are_an_error_naming_the_cause_and_the_fix(no_kernels):
    with pytest.raises(KernelUnavailable, match="OSD_NO_KERNELS.*--allow-kernel-fallback"):
        prepack_linears(shared_weights_copy(tiny_qwen2(seed=0)))
    with pytest.raises(KernelUnavailable, match="unavailable"):
        make_serving_draft(tiny_qwen2(seed=1, layers=1), "int8")
    assert kernels.status()["compiled"] is False and kernels.status()["fallback"] == []


def test_an_allowed_fallback_runs_on_torch_and_says_so(no_kernels):
    model = tiny_qwen2(seed=0)
    fast = shared_weights_copy(model)
    assert prepack_linears(fast, allow_fallback=True) > 0
    assert not any(isinstance(m, FastLinear) for m in fast.modules())  # oneDNN's linears instead
    serving, _ = make_serving_draft(tiny_qwen2(seed=1, layers=1), "int8", allow_kernel_fallback=True)
    assert not any(isinstance(m, Int8Linear) for m in serving.modules())  # torch's dynamic int8 instead
    status = kernels.status()
    assert status["compiled"] is False and "OSD_NO_KERNELS" in status["error"]
    assert status["fallback"] == ["draft int8 linears: torch dynamic int8", "target fp32 linears: oneDNN"]
    tokens = [3, 7, 11, 2]
    torch.testing.assert_close(CachedModel(fast).feed(tokens, 2), CachedModel(model).feed(tokens, 2), rtol=1e-4, atol=1e-4)


def test_the_fallback_is_a_model_config_field_and_a_cli_flag():
    from osd.cli import build_parser, config_from
    from osd.config import ModelConfig

    assert ModelConfig().allow_kernel_fallback is False
    args = build_parser().parse_args(["generate", "x", "--allow-kernel-fallback"])
    assert config_from(args, ModelConfig).allow_kernel_fallback is True


@pytest.fixture(scope="module")
def vnni(compiled):
    if not kernels.vnni_available():
        pytest.skip("this CPU has no AVX-512 VNNI")
    return compiled


@pytest.mark.parametrize("in_features,out_features", [(64, 40), (37, 5), (901, 333)])
def test_vnni_int8_path_is_row_invariant_and_close(vnni, in_features, out_features):
    torch.manual_seed(5)
    x, b = torch.randn(12, in_features), torch.randn(out_features)
    w8, scale = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8), torch.rand(out_features)
    alone = torch.cat([vnni.rows_linear_int8(x[i : i + 1], w8, scale, b, vnni=True) for i in range(12)])
    for start, rows in windows(12):
        assert torch.equal(vnni.rows_linear_int8(x[start : start + rows], w8, scale, b, vnni=True), alone[start : start + rows])
    reference = torch.nn.functional.linear(x.double(), w8.double() * scale.double()[:, None], b.double())
    error = (alone.double() - reference).norm() / reference.norm()
    assert 0 < error < 1e-2  # activations rounded to 8 bits per block of 32: close, not exact


def test_vnni_int8_serving_draft_is_row_invariant(vnni):
    serving, _ = make_serving_draft(tiny_qwen2(seed=1, layers=1), "int8_vnni")
    assert all(m.vnni for m in serving.modules() if isinstance(m, Int8Linear))
    assert model_logits_invariance(serving, 40, VOCAB) == []
