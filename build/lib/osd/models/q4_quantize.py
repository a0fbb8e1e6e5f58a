"""Float matrices -> llama.cpp's Q4_K / Q6_K block bytes (pure functions), so a torch model can run on the Q4 kernel.

The Q4 kernel (models/q4.py) reads ggml's Q4_K and Q6_K blocks, repacked. A GGUF brings them quantized; a draft
trained here (a Hugging Face Qwen2 whose master weights the learner updates) does not, so its Q4 serving copy
(models/q4_draft.py) quantizes each matrix at publish: `quantize_q4k(w)` / `quantize_q6k(w)` give the GGUF's own
block bytes, which `q4.repack_q4k` / `q4.repack_q6k` turn into the kernel's layout (the same path as a GGUF's
tensors), and which gguf's reference `dequantize` reads back (the tests check it).

The quantization is the plain one: per 32-weight sub-block a range [min(0, lo), hi] over 16 levels (Q4_K) or per
16-weight sub-block a symmetric scale over 64 levels (Q6_K), the sub-block scales then quantized to 6 (Q4_K) or 8
bits (Q6_K) against one float16 per 256-weight block, and each weight rounded against its sub-block's quantized
scale. llama.cpp's quantizer searches scales further (make_qkx2_quants), for a smaller error; a draft's precision
changes acceptance only, never an output (the target verifies every token), and acceptance is what is measured.

`pad_columns(w)` pads K (the input width) with zero columns to a multiple of 256, the kernel's block: the Qwen2.5
0.5B's hidden width 896 is not one (llama.cpp falls back to other types there); the runner pads the activations
the same way (zeros times zeros: the products are those of the unpadded matrix).
"""
from __future__ import annotations

import torch

from osd.errors import InvalidArgument

QK = 256  # weights per block
CHUNK_ROWS = 4096  # rows quantized at once (bounds the float temporaries: ~4096 x K x 4 bytes, a few times)
Q8_CHUNK_VALUES = 1 << 16  # weights per chunk of quantize_q8_0 (its temporaries stay in a core's cache)


def pad_columns(w: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N, K') float32, K' the next multiple of 256, the new columns zero (w itself where K' = K)."""
    pad = -w.shape[1] % QK
    w = w.detach().float()
    return torch.nn.functional.pad(w, (0, pad)) if pad else w


def _check(w: torch.Tensor) -> None:
    if w.dim() != 2 or w.shape[1] % QK or not w.is_floating_point():
        raise InvalidArgument(f"expected a float (N, K) matrix with K a multiple of {QK}, got {tuple(w.shape)} {w.dtype}")
    if not torch.isfinite(w).all():
        raise InvalidArgument("the matrix holds inf or NaN: it cannot be quantized")


def _half_bytes(x: torch.Tensor) -> torch.Tensor:  # (...) float16 -> (..., 2) uint8
    return x.contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b where b > 0, else 0."""
    return torch.where(b > 0, a / torch.where(b > 0, b, torch.ones_like(b)), torch.zeros_like(a))


def q4k_components(w: torch.Tensor):
    """(N, K) float -> Q4_K's quants (N, B, 256) 0..15, sub-block scales and mins (N, B, 8) 0..63, d and dmin (N, B)
    float16: weight = d * scale * q - dmin * min, per 32-weight sub-block."""
    x = w.float().reshape(w.shape[0], -1, 8, 32)
    lo, hi = x.amin(-1).clamp(max=0), x.amax(-1)  # (N, B, 8): the range a sub-block's 16 levels cover
    scale, minimum = (hi - lo) / 15, -lo
    d, dmin = (scale.amax(-1) / 63).half(), (minimum.amax(-1) / 63).half()  # (N, B)
    sc = _safe_div(scale, d.float()[..., None]).round().clamp(0, 63)
    mins = _safe_div(minimum, dmin.float()[..., None]).round().clamp(0, 63)
    step, offset = d.float()[..., None] * sc, dmin.float()[..., None] * mins  # what dequantization will use
    q = _safe_div(x + offset[..., None], step[..., None]).round().clamp(0, 15)
    return q.reshape(w.shape[0], -1, QK).to(torch.uint8), sc.to(torch.uint8), mins.to(torch.uint8), d, dmin


def pack_q4k(q: torch.Tensor, sc: torch.Tensor, mins: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    """Q4_K's components -> ggml's block_q4_K bytes (N, B * 144): d, dmin, 12 bytes of 6-bit scales and mins (the
    inverse of q4.q4k_scales), 128 bytes of nibbles (element 64 c + i low, 64 c + 32 + i high in byte 32 c + i)."""
    n, b = q.shape[:2]
    scales = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mins[..., :4] | ((mins[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 0xF) | ((mins[..., 4:] & 0xF) << 4)], dim=-1)  # (N, B, 12)
    pairs = q.reshape(n, b, 4, 2, 32)
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(n, b, 128)
    return torch.cat([_half_bytes(d), _half_bytes(dmin), scales, qs], dim=-1).reshape(n, b * 144)


def q6k_components(w: torch.Tensor):
    """(N, K) float -> Q6_K's quants (N, B, 256) 0..63 (value q - 32), sub-block scales (N, B, 16) int8 and d (N, B)
    float16: weight = d * scale * (q - 32), per 16-weight sub-block."""
    x = w.float().reshape(w.shape[0], -1, 16, 16)
    scale = x.abs().amax(-1) / 31  # (N, B, 16): levels -31..31 of the -32..31 the format holds
    d = (scale.amax(-1) / 127).half()
    sc = _safe_div(scale, d.float()[..., None]).round().clamp(0, 127)
    step = d.float()[..., None] * sc
    q = _safe_div(x, step[..., None]).round().clamp(-32, 31) + 32
    return q.reshape(w.shape[0], -1, QK).to(torch.uint8), sc.to(torch.int8), d


def pack_q6k(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q6_K's components -> ggml's block_q6_K bytes (N, B * 210): ql (low 4 bits), qh (high 2 bits), 16 int8 scales,
    d; the inverse of q4.q6k_quants (per half of 128: runs 0 and 2 share ql bytes 0..31, runs 1 and 3 bytes 32..63,
    run r's high bits at bits 2 r of qh)."""
    n, b = q.shape[:2]
    runs = q.reshape(n, b, 2, 4, 32)
    low, high = runs & 0xF, runs >> 4
    ql = torch.cat([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], dim=-1)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    return torch.cat([ql.reshape(n, b, 128), qh.reshape(n, b, 64), sc.view(torch.uint8), _half_bytes(d)],
                     dim=-1).reshape(n, b * 210)


def quantize_q4k(w: torch.Tensor) -> torch.Tensor:
    """(N, K) float, K a multiple of 256 -> GGUF Q4_K bytes (N, K / 256 * 144) uint8."""
    _check(w)
    return torch.cat([pack_q4k(*q4k_components(part)) for part in w.split(CHUNK_ROWS)])


def quantize_q6k(w: torch.Tensor) -> torch.Tensor:
    """(N, K) float, K a multiple of 256 -> GGUF Q6_K bytes (N, K / 256 * 210) uint8."""
    _check(w)
    return torch.cat([pack_q6k(*q6k_components(part)) for part in w.split(CHUNK_ROWS)])


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """(N, K) float -> (N, K / 32 * 34) uint8: ggml's Q8_0 rows (per 32 weights a float16 scale amax / 127 and 32
    int8 quants rounded half away from zero), bit for bit what gguf's `quantize(w, Q8_0)` gives (the same float32
    operations, vectorized in torch: a draft's 151,936-row token table in a fraction of a second instead of ~1.4 s of
    numpy row groups at each publish). Rows go in chunks that stay in cache."""
    if w.dim() != 2 or w.shape[1] % 32 or not w.is_floating_point():
        raise InvalidArgument(f"expected a float (N, K) matrix with K a multiple of 32, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    out = torch.empty(n, k // 32 * 34, dtype=torch.uint8)
    step = max(1, Q8_CHUNK_VALUES // k)
    for start in range(0, n, step):
        blocks = w[start : start + step].detach().float().reshape(-1, 32)  # (B, 32)
        magnitude = blocks.abs()
        d = magnitude.amax(dim=1, keepdim=True) / 127  # inf or NaN anywhere in a block reaches its d
        if not torch.isfinite(d).all():
            raise InvalidArgument("the matrix holds inf or NaN: it cannot be quantized")
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        a = magnitude * inv  # |blocks * inv|, inv >= 0
        floored = a.floor()
        q = torch.copysign(floored + (2 * (a - floored)).floor(), blocks)  # gguf's np_roundf (zeros stay 0 as int8)
        packed = torch.cat([_half_bytes(d.squeeze(1).half()), q.to(torch.int8).view(torch.uint8)], dim=1)  # (B, 34)
        out[start : start + step] = packed.reshape(-1, k // 32 * 34)
    return out
