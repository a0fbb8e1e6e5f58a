"""The Q4_K/Q6_K multi-row kernel (models/q4.py, q4_kernel.cpp) against independent references.

References: gguf's own numpy dequantization of the same GGUF block bytes (not our repacking), and ggml's
quantize_row_q8_K_ref written out in torch below. Both CPU paths (AVX2, AVX-512 VNNI where the CPU has it).
"""
import numpy as np
import pytest
from conftest import require_q4
import torch
from gguf import GGMLQuantizationType, dequantize

from osd.errors import InvalidArgument
from osd.models import q4

require_q4()

ISAS = ["avx2"] + (["avx512_vnni"] if q4.available() and q4.has_vnni() else [])


def random_blocks(n: int, k: int, type_name: str, seed: int) -> torch.Tensor:
    """Random GGUF block bytes (n, k / 256 * block bytes) with finite, realistic fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    size = q4.Q4K_BLOCK_BYTES if type_name == "Q4_K" else q4.Q6K_BLOCK_BYTES
    raw = torch.randint(0, 256, (n, k // 256, size), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // 256, 2, generator=g) * 0.02 + 1e-4).half().view(torch.uint8).reshape(n, k // 256, 4)
    if type_name == "Q4_K":
        raw[..., 0:4] = scale  # d, dmin
    else:
        raw[..., 208:210] = scale[..., 0:2]  # d
    return raw.reshape(n, -1)


def dequantized(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """gguf's reference dequantization -> (N, K) float64."""
    qtype = GGMLQuantizationType[type_name]
    return torch.from_numpy(dequantize(raw.numpy(), qtype).astype(np.float64))


def q8k_reference(x: torch.Tensor):
    """ggml's quantize_row_q8_K_ref in torch: (M, K) -> quants (M, B, 256) natural order, d (M, B), bsums (M, B, 16)."""
    blocks = x.float().reshape(x.shape[0], -1, 256)
    mag = blocks.abs()
    amax = mag.amax(-1, keepdim=True)
    first = (mag == amax).int().argmax(-1, keepdim=True)  # first element of largest magnitude, with its sign
    top = blocks.gather(-1, first)
    iscale = torch.full_like(top, -127.0) / top  # float32 division as in C (python-scalar / tensor is reciprocal * scalar)
    q = torch.round(iscale * blocks).clamp(max=127)  # round half to even, as nearest_int
    zero = amax == 0
    q = torch.where(zero, 0.0, q).to(torch.int8)
    d = torch.where(zero, 0.0, torch.ones_like(iscale) / iscale)[..., 0]
    bs = q.reshape(*q.shape[:2], 16, 16).sum(-1).to(torch.int16)
    return q, d, bs


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 5] *= 30  # an outlier channel, as hidden states have
    if m > 1:
        x[1, :256] = 0  # an all-zero block
    return x


def test_activation_quantization_is_ggmls_bit_for_bit():
    x = activations(5, 768, seed=1)
    x[2, 256 + 7], x[2, 256 + 9] = -50.0, 50.0  # equal magnitudes: the first one's sign decides
    acts = q4.quantize_activations(x)
    q, d, bs = q8k_reference(x)
    assert torch.equal(acts.q, q[..., q4.kernel_order()])  # kernel order = natural order permuted
    assert torch.equal(acts.d, d)
    pairs = bs.reshape(5, 3, 8, 2)  # ggml's bsums, as the kernels use them: Q4_K's min sums, Q6_K's -32 offsets
    assert torch.equal(acts.bs32, (pairs[..., 0] + pairs[..., 1]).short())
    assert torch.equal(acts.nbs, -32 * torch.cat([pairs[..., 0], pairs[..., 1]], dim=-1).int())
    assert acts.d[2, 1] > 0 and acts.d[1, 0] == 0


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("n,k", [(40, 512), (17, 768), (3, 256), (32, 256)])  # whole and partial tiles of 16
def test_matmul_matches_dequantized_reference(type_name, n, k, isa):
    raw = random_blocks(n, k, type_name, seed=n + k)
    weight = q4.repack(raw, type_name)
    assert weight.shape == (n, k)
    x = activations(9, k, seed=k)
    acts = q4.quantize_activations(x)
    q, d, _ = q8k_reference(x)
    x_deq = (q.double() * d.double()[..., None]).reshape(9, k)  # what the kernel multiplies: the quantized rows
    w_deq = dequantized(raw, type_name)
    expected = x_deq @ w_deq.T  # (M, N) float64
    scale = x_deq.abs() @ w_deq.abs().T
    got = q4.matmul(acts, weight, isa)
    assert got.shape == (9, n) and got.dtype == torch.float32
    assert ((got.double() - expected).abs() <= 2e-6 * scale + 1e-7).all()


def test_a_wrong_layout_would_fail_the_reference_check():
    """The tolerance above is tight enough to catch a swapped scale (a bug the kernel could have)."""
    raw = random_blocks(8, 512, "Q4_K", seed=3)
    weight = q4.repack_q4k(raw)
    swapped = q4.Q4KWeight(weight.n, weight.qs, weight.sm[..., [1, 0, *range(2, 256)]].contiguous(), weight.dd)
    x = activations(2, 512, seed=4)
    q, d, _ = q8k_reference(x)
    expected = (q.double() * d.double()[..., None]).reshape(2, 512) @ dequantized(raw, "Q4_K").T
    got = q4.matmul(q4.quantize_activations(x), swapped)
    assert ((got.double() - expected).abs() > 1e-3 * expected.abs().max()).any()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_each_row_is_bitwise_independent_of_the_row_count(type_name):
    raw = random_blocks(33, 1024, type_name, seed=7)
    weight = q4.repack(raw, type_name)
    x = activations(17, 1024, seed=8)  # 17 rows: passes of 8, 8 and 1 over the weight
    acts = q4.quantize_activations(x)
    for isa in ISAS:
        full = q4.matmul(acts, weight, isa)
        for m in range(1, 10):
            part = q4.matmul(q4.quantize_activations(x[:m]), weight, isa)
            assert torch.equal(part, full[:m]), (isa, m)
        for i in range(x.shape[0]):
            alone = q4.matmul(q4.quantize_activations(x[i : i + 1]), weight, isa)
            assert torch.equal(alone[0], full[i]), (isa, i)


def test_isa_forced_by_environment(monkeypatch):
    monkeypatch.setenv("OSD_Q4_ISA", "avx2")
    assert q4.resolve_isa() == "avx2"
    monkeypatch.setenv("OSD_Q4_ISA", "sse9")
    with pytest.raises(InvalidArgument, match="unknown ISA"):
        q4.resolve_isa()


def test_refuses_what_it_does_not_handle():
    with pytest.raises(InvalidArgument, match="multiple of 256"):
        q4.quantize_activations(torch.randn(2, 100))
    weight = q4.repack_q4k(random_blocks(4, 512, "Q4_K", seed=0))
    with pytest.raises(InvalidArgument, match="K = 256"):
        q4.matmul(q4.quantize_activations(torch.randn(2, 256)), weight)
    with pytest.raises(InvalidArgument, match="runs Q4_K, .*not Q3_K"):
        q4.repack(torch.zeros(2, 110, dtype=torch.uint8), "Q3_K")
    with pytest.raises(InvalidArgument, match="block bytes"):
        q4.repack_q4k(torch.zeros(2, 100, dtype=torch.uint8))
