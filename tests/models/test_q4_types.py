"""The kernel's other GGUF matrix types (models/q4.py, q4_kernel.cpp): Q8_0, Q4_0, Q4_1, Q5_K, Q5_0, Q5_1 vs references.

References: gguf's own numpy dequantization of the same GGUF block bytes (not our repacking), and the activations'
per-32 quantization written out in torch below. Every type: within a stated tolerance of the float64 product of the
dequantized matrix and the quantized activations the kernel multiplies (the integer sums are exact; only the float
sum over sub-blocks rounds), each row bitwise independent of the row count, AVX2 and AVX-512 VNNI bitwise equal.
"""
import pytest
from conftest import require_q4
import torch
from gguf import GGMLQuantizationType, quantize

from osd.errors import InvalidArgument
from osd.models import q4
from tests.models.test_q4_kernel import activations, dequantized, q8k_reference
from tests.models.test_q4_kernel import random_blocks as random_k_blocks  # Q4_K, Q6_K

require_q4()

ISAS = ["avx2"] + (["avx512_vnni"] if q4.available() and q4.has_vnni() else [])
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_K", "Q5_0", "Q5_1"]
BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_K": (256, 176), "Q5_0": (32, 22),
         "Q5_1": (32, 24)}  # weights, bytes per block
BLOCK_32 = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
TOLERANCE = 5e-7  # of sum |x| |w| per output (measured max: Q8_0 4.8e-8, Q4_0 5.2e-8, Q4_1 6.9e-8, Q5_K 4.2e-8,
#                   Q5_0 6.1e-8, Q5_1 7.1e-8)


def random_blocks(n: int, k: int, type_name: str, seed: int) -> torch.Tensor:
    """Random valid GGUF block bytes (n, k / weights per block * bytes): random quants, small finite fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    weights, size = BLOCK[type_name]
    raw = torch.randint(0, 256, (n, k // weights, size), dtype=torch.uint8, generator=g)
    halves = ((torch.rand(n, k // weights, 2, generator=g) - 0.3) * 0.02).half()  # signed
    if type_name == "Q5_K":
        halves = halves.abs()  # d, dmin >= 0 as Q4_K's; its 6-bit scales and mins are random bytes
    scale = halves.view(torch.uint8).reshape(n, -1, 4)
    if type_name in ("Q8_0", "Q4_0", "Q5_0"):
        raw[..., 0:2] = scale[..., 0:2]  # d (Q8_0's is >= 0 in a real file, the kernel does not care)
    else:
        raw[..., 0:4] = scale  # Q4_1, Q5_1: d, m; Q5_K: d, dmin
    return raw.reshape(n, -1)


def q8_32_reference(x: torch.Tensor):
    """The activations' per-32 quantization in torch: (M, K) -> quants (M, K / 32, 32), d (M, K / 32)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127
    inverse = torch.where(amax > 0, torch.ones_like(d) / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse).clamp(-127, 127).to(torch.int8)  # half to even, as the kernel's cvtps
    return q, d[..., 0]


def quantized_rows(x: torch.Tensor, type_name: str) -> torch.Tensor:
    """(M, K) float64: the activations as the kernel multiplies them for `type_name`."""
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        q, d, _ = q8k_reference(x)
    else:
        q, d = q8_32_reference(x)
    return (q.double() * d.double()[..., None]).reshape(x.shape)


def test_per_32_activation_quantization_matches_the_reference_bit_for_bit():
    x = activations(5, 768, seed=1)
    x[3, 32:64] = 0  # an all-zero sub-block
    x[2, 64 + 3], x[2, 64 + 9] = -50.0, 50.0
    acts = q4.quantize_activations(x)
    q, d = q8_32_reference(x)
    assert torch.equal(acts.q32, q.reshape(5, 3, 256)[..., q4.kernel_order()])
    assert torch.equal(acts.d32, d.reshape(5, 3, 8))
    assert torch.equal(acts.s32, q.int().sum(-1).reshape(5, 3, 8))
    assert acts.d32[3, 0, 1] == 0 and (acts.q32[1, 0] == 0).all()  # row 1's first block is all zero
    q8k, d8k, _ = q8k_reference(x)  # the Q8_K part is unchanged
    assert torch.equal(acts.q, q8k[..., q4.kernel_order()]) and torch.equal(acts.d, d8k)


def max_error_ratio(got: torch.Tensor, raw: torch.Tensor, x: torch.Tensor, type_name: str) -> float:
    x_deq, w_deq = quantized_rows(x, type_name), dequantized(raw, type_name)
    expected, scale = x_deq @ w_deq.T, x_deq.abs() @ w_deq.abs().T
    return ((got.double() - expected).abs() / (scale + 1e-30)).max().item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n,k", [(40, 512), (17, 768), (3, 256), (32, 256)])  # whole and partial tiles of 16
def test_matmul_matches_dequantized_reference(type_name, n, k, isa):
    raw = random_blocks(n, k, type_name, seed=n + k)
    weight = q4.repack(raw, type_name)
    assert weight.shape == (n, k) and weight.TYPE == type_name
    x = activations(9, k, seed=k)
    got = q4.matmul(q4.quantize_activations(x), weight, isa)
    assert got.shape == (9, n) and got.dtype == torch.float32
    assert max_error_ratio(got, raw, x, type_name) <= TOLERANCE  # float32 sums of 8 sub-blocks a 256-block


@pytest.mark.parametrize("type_name", BLOCK_32)
def test_matmul_on_blocks_quantized_by_gguf(type_name):
    """Blocks as a real file holds them (gguf's own quantizer of a float matrix), not only random bytes."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 1024, generator=g) * 0.05
    raw = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[type_name]))
    x = activations(3, 1024, seed=6)
    for isa in ISAS:
        got = q4.matmul(q4.quantize_activations(x), q4.repack(raw, type_name), isa)
        assert max_error_ratio(got, raw, x, type_name) <= TOLERANCE


def test_a_wrong_layout_would_fail_the_reference_check():
    """The tolerance is tight enough to catch two swapped sub-block scales."""
    raw = random_blocks(16, 512, "Q8_0", seed=3)
    weight = q4.repack(raw, "Q8_0")
    swapped = q4.Q8_0Weight(weight.n, weight.qs, weight.d[:, [16, *range(1, 16), 0, *range(17, 128)]].contiguous())
    x = activations(2, 512, seed=4)
    assert max_error_ratio(q4.matmul(q4.quantize_activations(x), swapped), raw, x, "Q8_0") > 1e-3


@pytest.mark.parametrize("type_name", TYPES)
def test_each_row_is_bitwise_independent_of_the_row_count(type_name):
    raw = random_blocks(33, 1024, type_name, seed=7)
    weight = q4.repack(raw, type_name)
    x = activations(17, 1024, seed=8)  # 17 rows: passes of 8, 8 and 1 over the weight
    acts = q4.quantize_activations(x)
    for isa in ISAS:
        full = q4.matmul(acts, weight, isa)
        for m in range(1, 10):
            assert torch.equal(q4.matmul(q4.quantize_activations(x[:m]), weight, isa), full[:m]), (isa, m)
        for i in range(x.shape[0]):
            assert torch.equal(q4.matmul(q4.quantize_activations(x[i : i + 1]), weight, isa)[0], full[i]), (isa, i)


@pytest.mark.skipif(len(ISAS) < 2, reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", *TYPES])
def test_every_path_agrees_bitwise(type_name):
    """AVX2 and VNNI, every type the kernel runs: the same exact integer sums, then the same float instructions lane by
    lane, at any row count (whole passes of 8 rows and a last pass of 1-7)."""
    make = random_k_blocks if type_name in ("Q4_K", "Q6_K") else random_blocks
    raw = make(21, 1280, type_name, seed=11)
    weight = q4.repack(raw, type_name)
    for m in (1, 2, 3, 6, 8, 13, 19):
        acts = q4.quantize_activations(activations(m, 1280, seed=12 + m))
        reference = q4.matmul(acts, weight, "avx2")
        for isa in ISAS[1:]:
            assert torch.equal(q4.matmul(acts, weight, isa), reference), (isa, m)


def test_extreme_quants_are_exact():
    """Q8_0's -128 (never written by llama.cpp, valid in the format) and +127 against +-127 activations: the
    AVX2 path's sign trick and the VNNI path's +128 shift stay exact (no int16 saturation)."""
    raw = random_blocks(16, 256, "Q8_0", seed=2).reshape(16, 8, 34)
    raw[..., 2:] = torch.tensor([-128, 127], dtype=torch.int8).repeat(16).view(torch.uint8)
    raw[..., 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    raw = raw.reshape(16, -1)
    x = torch.tensor([[-1.0, 1.0] * 128, [1.0, -1.0] * 128])  # quants -127, 127
    for isa in ISAS:
        got = q4.matmul(q4.quantize_activations(x), q4.repack(raw, "Q8_0"), isa)
        d = (1.0 / 127) * 127  # d32 * 127 = 1 up to float rounding
        assert torch.allclose(got, torch.tensor([[255.0 * 128 * d] * 16, [-255.0 * 128 * d] * 16]), rtol=1e-6)


@pytest.mark.parametrize("type_name", ["Q3_K", "IQ4_XS", "Q2_K", "F16"])
def test_an_unsupported_type_is_an_error_naming_it_and_the_fallback(type_name):
    with pytest.raises(InvalidArgument, match=f"is {type_name}:.*not {type_name}.*llama.cpp"):
        q4.repack(torch.zeros(2, 256, dtype=torch.uint8), type_name)


@pytest.mark.parametrize("type_name", BLOCK_32)
def test_rows_of_a_multiple_of_32_are_padded_with_zero_blocks(type_name):
    """K = 288 (9 GGUF blocks, as the 0.5B's 896 is 28): the weight is padded to K = 512 with zero blocks, the
    activations with zero columns (q4_runner.padded), and the product is the unpadded one's."""
    raw = random_blocks(20, 288, type_name, seed=9)
    weight = q4.repack(raw, type_name)
    assert weight.shape == (20, 512)
    x = activations(3, 288, seed=10)
    padded = torch.nn.functional.pad(x, (0, 512 - 288))
    for isa in ISAS:
        got = q4.matmul(q4.quantize_activations(padded), weight, isa)
        assert max_error_ratio(got, raw, x, type_name) <= TOLERANCE
