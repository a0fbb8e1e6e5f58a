"""Fast linears (models/prepack.py, models/kernels.py) equal torch's linear up to float rounding
(their row invariance: test_kernel_invariance.py)."""
import pytest
from conftest import skip_or_fail
import torch
from conftest import tiny_qwen2

from osd.errors import KernelUnavailable
from osd.models.cached import CachedModel
from osd.models.kernels import rows_linear
from osd.models.prepack import FastLinear, prepack_linears, shared_weights_copy


def compiled(getter):
    try:
        return getter()
    except KernelUnavailable as e:
        skip_or_fail(f"the compiled kernels cannot be built here: {e}")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_features,out_features", [(64, 40), (37, 5), (1536, 9)])
def test_fast_linear_matches_torch_for_every_row_count(in_features, out_features, bias):
    kernel = compiled(rows_linear)
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    fast = FastLinear(linear, kernel)
    assert fast.weight.data_ptr() == linear.weight.data_ptr()  # shares the weight: no extra memory
    for rows in list(range(1, 12)) + [40]:  # decoding, verification, a prefill
        x = torch.randn(1, rows, in_features)  # (B, T, K) as a decoder layer passes it
        with torch.inference_mode():
            expected = torch.nn.functional.linear(x.double(), linear.weight.double(),
                                                  None if linear.bias is None else linear.bias.double()).float()
            assert fast(x).shape == (1, rows, out_features)
            torch.testing.assert_close(fast(x), expected, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_what_it_does_not_handle():
    kernel = compiled(rows_linear)
    with pytest.raises(RuntimeError, match=r"x \(M, K\), w \(N, K\)"):
        kernel(torch.randn(9, 16), torch.randn(4, 15), None)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.randn(2, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64), None)


def test_prepacked_model_gives_the_same_logits_and_keeps_the_original_plain():
    compiled(rows_linear)
    model = tiny_qwen2(seed=0)
    fast = shared_weights_copy(model)
    assert prepack_linears(fast) > 0
    assert all(type(m) is not FastLinear for m in model.modules())  # the original is untouched
    assert model.config._attn_implementation != fast.config._attn_implementation == "osd_rows"
    tokens = [3, 7, 11, 2, 9, 4]
    plain, packed = CachedModel(model), CachedModel(fast)
    plain.feed(tokens[:3]), packed.feed(tokens[:3])
    for n in (1, 3):  # one-row and several-row paths, over a KV cache
        torch.testing.assert_close(packed.feed(tokens[3 : 3 + n], n_logits=n), plain.feed(tokens[3 : 3 + n], n_logits=n),
                                   rtol=1e-4, atol=1e-4)
        plain.rollback(3), packed.rollback(3)


def test_int8_serving_linear_is_close_to_fp32_for_every_row_count():
    from osd.models.kernels import rows_linear_int8
    from osd.models.serving_draft import Int8Linear

    kernel = compiled(rows_linear_int8)
    torch.manual_seed(0)
    linear = torch.nn.Linear(200, 33)
    int8 = Int8Linear(linear, kernel)
    dequantized = int8.weight_int8.float() * int8.scale[:, None]  # what the kernel multiplies by, exactly
    assert (dequantized - linear.weight).abs().max() <= int8.scale.max() / 2 + 1e-7  # rounding error only
    for rows in list(range(1, 11)) + [40]:
        x = torch.randn(1, rows, 200)
        with torch.inference_mode():
            torch.testing.assert_close(int8(x), torch.nn.functional.linear(x, dequantized, linear.bias), rtol=1e-5, atol=1e-5)
