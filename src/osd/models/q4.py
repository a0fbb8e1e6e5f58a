"""Multi-row products on llama.cpp's quantized weights with our own CPU kernel (q4_kernel.cpp): Q4_K, Q5_K, Q6_K,
Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 matrices (`MATRIX_TYPES`); any other type is an error naming it and llama.cpp
(`unsupported`), never a conversion to one of these (that would not be the user's model).

Verification multiplies k+1 rows by every target weight. `matmul(quantize_activations(x), weight)` reads each
weight block once for up to 8 rows and computes ggml's math: activations quantized per 256-block to int8 with one
scale exactly as llama.cpp does (`quantize_row_q8_K_ref`) for the K-quants, per 32 (as its Q8_0, scale kept float32)
for the 32-weight types; exact integer block dot products, only the float sum over blocks in another order than
ggml's. Each row's result is bitwise the same whatever the number of rows computed with it, and the AVX2 and AVX-512
VNNI paths give bitwise equal results (every type).

Measured here (`osd bench kernel --clock cpu`: 1 thread, CPU time, AMD EPYC Zen 4; ms per token for all 196 layer
matrices + the LM head, weights streaming from memory; llama.cpp = its whole forward, same thread/clock;
benchmarks/bench-kernel-cpu-x16-rerun.json and bench-kernel-cpu-avx2-x16.json):

    rows                              1      2      4      8
    this kernel, AVX-512 VNNI      51.0   54.8   66.8   98.9   (1.07x / 1.31x / 1.94x one row)
    this kernel, AVX2 path         53.3   61.4   91.3  173.7
    llama.cpp (AVX2 build)         53.7  106.5  177.8  500.3   (1.98x / 3.31x / 9.32x)

The other types at one 8960x1536 matrix (scripts/bench_q4_types.py, same clock, rough: a shared machine), x Q4_K's
cost at 1 / 4 / 8 rows, VNNI: Q5_K 1.03 / 1.25 / 1.04, Q8_0 2.05 / 2.74 / 1.68 (8.5 bits a weight: one row reads
1.8x the bytes), Q4_0 1.03 / 1.11 / 0.91, Q4_1 0.99 / 1.25 / 1.04; AVX2 within 0.98-1.2x of Q4_K except Q8_0 (2.2x
at 1 row, 1.2x at 8). Q5_0 / Q5_1 (Q4_0 / Q4_1's loop plus Q5_K's bit plane) were not measured.

One row is memory-bound; more rows are compute-bound. Each vector lane is one output column (16 columns interleaved),
so the sub-block scales apply in exact integers and a row, block and 16 columns take one or two float steps. With
only 16 vector registers the AVX2 path spills beyond ~4 rows (5-8 rows: 1.03-1.15x the per-column layout it replaced).

Weights are repacked once from the GGUF's blocks (`repack`: same bytes per block, another order, K-quant scales
unpacked; layouts in q4_kernel.cpp). The path runs where the CPU has AVX2 (AVX-512 VNNI is used where present, chosen
at run time; OSD_Q4_ISA=avx2 forces AVX2). The build (~1 min) happens once per machine and torch version, in
torch's extension cache. Limitations: K a multiple of 256 (the 32-weight types' matrices are padded to one); no
bias. Used by the `osd` target backend (models/q4_runner.py); `osd bench kernel` measures it alone against the
target's shapes.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch

from osd.errors import BackendUnavailable, InvalidArgument

QK = 256  # weights per K-quant block
Q4K_BLOCK_BYTES = 144  # ggml's block_q4_K
Q6K_BLOCK_BYTES = 210  # ggml's block_q6_K
Q5K_BLOCK_BYTES = 176  # ggml's block_q5_K
Q8_0_BLOCK_BYTES = 34
Q4_1_BLOCK_BYTES = 20  # ggml's block_q4_1: 32 weights
Q5_0_BLOCK_BYTES = 22  # ggml's block_q5_0: 32 weights
Q5_1_BLOCK_BYTES = 24  # ggml's block_q5_1: 32 weights
Q4_0_BLOCK_BYTES = 18  # ggml's block_q4_0: 32 weights  # ggml's block_q8_0: 32 weights
ROWS_PER_PASS = 8  # q4_kernel.cpp MAX_R: rows multiplied per pass over a weight; one more row costs another pass
ISAS = {"best": 0, "avx2": 1, "avx512_vnni": 2}
TILE = 16  # output columns per tile of the weight layout (q4_kernel.cpp's TILE)

_lock = threading.Lock()
_state: dict = {}


# ------------------------------------------------------------------------------------------ build and dispatch
def _module():
    with _lock:
        if "module" not in _state:
            _state["module"], _state["error"] = _build()
        return _state["module"]


def _build():
    from osd.models.kernels import compile_extension

    return compile_extension("osd_q4_kernel", "q4_kernel.cpp", "the Q4_K/Q6_K CPU kernels", "~1 min",
                             ["-mavx2", "-mfma", "-mf16c"])


def available() -> bool:
    return _module() is not None


def build_error() -> str | None:
    """Why the kernel is unavailable (after available() returned False)."""
    _module()
    return _state.get("error")


def kernel():
    module = _module()
    if module is None:
        raise BackendUnavailable(f"the Q4_K CPU kernel is unavailable here: {_state.get('error')}")
    return module


def has_vnni() -> bool:
    """Whether this CPU runs the AVX-512 VNNI path."""
    return bool(kernel().has_vnni())


def resolve_isa(isa: str | None = None) -> str:
    """The path a call runs: `isa`, else $OSD_Q4_ISA, else the best this CPU has ('avx512_vnni' or 'avx2')."""
    isa = isa or os.environ.get("OSD_Q4_ISA") or "best"
    if isa not in ISAS:
        raise InvalidArgument(f"unknown ISA {isa!r}: one of {', '.join(ISAS)}")
    if isa == "best":
        return "avx512_vnni" if has_vnni() else "avx2"
    if isa == "avx512_vnni" and not has_vnni():
        raise InvalidArgument("this CPU has no AVX-512 VNNI")
    return isa


# ------------------------------------------------------------------------------------------ tensors
class Q8KActivations(NamedTuple):
    """Rows quantized as ggml's Q8_K, and per 32-weight sub-block as its Q8_0 (for the 32-block weight types): one
    record per row and 256-block (the `Rec` struct of q4_kernel.cpp)."""

    records: torch.Tensor  # (M, B, 704) uint8

    def _field(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return self.records[..., start:stop].contiguous().view(dtype)

    @property
    def q(self) -> torch.Tensor:  # (M, B, 256) int8, kernel order
        return self._field(0, 256, torch.int8)

    @property
    def nbs(self) -> torch.Tensor:  # (M, B, 16) int32: -32 * sums of 16-element sub-blocks 0, 2, .., 14, 1, 3, .., 15
        return self._field(256, 320, torch.int32)

    @property
    def d(self) -> torch.Tensor:  # (M, B) float32: block = d * q
        return self._field(320, 324, torch.float32)[..., 0]

    @property
    def bs32(self) -> torch.Tensor:  # (M, B, 8) int16: sums of the quants of 32-element sub-blocks
        return self._field(324, 340, torch.int16)

    @property
    def q32(self) -> torch.Tensor:  # (M, B, 256) int8, kernel order: per-32 quants
        return self._field(384, 640, torch.int8)

    @property
    def d32(self) -> torch.Tensor:  # (M, B, 8) float32: sub-block l = d32[l] * its q32
        return self._field(640, 672, torch.float32)

    @property
    def s32(self) -> torch.Tensor:  # (M, B, 8) int32: sums of the per-32 quants of sub-block l
        return self._field(672, 704, torch.int32)


class _Weight:
    """What every repacked weight has: `n` output features, then its tensors (the kernel function's arguments, in
    order, each (T B, ...) for T = ceil(N / 16) tiles of columns and B blocks of 256 weights)."""

    TYPE: ClassVar[str]  # the GGML type name
    KERNEL: ClassVar[str]  # the kernel's function: (activations, *tensors, n, isa) -> (M, N)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)[1:]]

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.tensors()[0].shape[0] // -(-self.n // TILE) * QK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass(frozen=True)
class Q4KWeight(_Weight):
    """A Q4_K matrix (N, K) repacked for the kernel, columns interleaved 16 at a time (q4_kernel.cpp): 148 bytes per
    256 weights (the GGUF's 144, scales unpacked), N padded with zero columns to a multiple of 16.

    Per (tile of 16 columns, block), tile-major: `qs` their weights as 32 lines of 64 bytes (`interleave_q4k`), `sm`
    their sub-block scales then their mins, `dd` their d then their dmin.
    """

    n: int  # output features N
    qs: torch.Tensor  # (T B, 2048) uint8: nibbles, T = ceil(N / 16)
    sm: torch.Tensor  # (T B, 256) uint8: 16 x 8 sub-block scales, 16 x 8 mins (6-bit)
    dd: torch.Tensor  # (T B, 32) float16: 16 d, 16 dmin
    TYPE, KERNEL = "Q4_K", "q4k_matmul"


@dataclass(frozen=True)
class Q6KWeight(_Weight):
    """A Q6_K matrix (N, K) repacked for the kernel, 16 columns interleaved as Q4KWeight: 210 bytes per 256 weights,
    as in the GGUF; N padded with zero columns to a multiple of 16 (`interleave_q6k`)."""

    n: int
    ql: torch.Tensor  # (T B, 2048) uint8: low 4 bits, T = ceil(N / 16)
    qh: torch.Tensor  # (T B, 1024) uint8: high 2 bits
    sc: torch.Tensor  # (T B, 256) int8: 16 x 16 sub-block scales
    d: torch.Tensor  # (T B, 16) float16
    TYPE, KERNEL = "Q6_K", "q6k_matmul"


@dataclass(frozen=True)
class Q5KWeight(_Weight):
    """A Q5_K matrix (N, K) repacked for the kernel: Q4KWeight's layout for the low 4 bits, scales and mins, plus `qh`
    the fifth bits (`interleave_q5k`): 180 bytes per 256 weights (the GGUF's 176, scales unpacked)."""

    n: int
    qs: torch.Tensor  # (T B, 2048) uint8: low 4 bits, as Q4KWeight's
    qh: torch.Tensor  # (T B, 512) uint8: line l's byte 4 i + t, bit v = column i's element 32 l + 4 v + t's fifth bit
    sm: torch.Tensor  # (T B, 256) uint8: as Q4KWeight's
    dd: torch.Tensor  # (T B, 32) float16: as Q4KWeight's
    TYPE, KERNEL = "Q5_K", "q5k_matmul"


@dataclass(frozen=True)
class Q8_0Weight(_Weight):
    """A Q8_0 matrix (N, K) repacked for the kernel, 16 columns interleaved: 34 bytes per 32 weights, as in the GGUF;
    per (tile, 256 weights) `qs` 64 lines of 64 bytes, line 8 l + v's lane i = column i's int8 weights 32 l + 4 v +
    (0..3) (`_interleaved_groups`), `d` the 16 columns' 8 sub-block scales, l-major (16 l + i)."""

    n: int
    qs: torch.Tensor  # (T B, 4096) uint8: the int8 quants' bytes
    d: torch.Tensor  # (T B, 128) float16
    TYPE, KERNEL = "Q8_0", "q8_0_matmul"


@dataclass(frozen=True)
class Q4_1Weight(_Weight):
    """A Q4_1 matrix (N, K) repacked for the kernel: `qs` as Q4_0Weight's (value q d + m), `dm` the 16 columns' 8
    sub-block d, then their 8 m, l-major: 20 bytes per 32 weights, as in the GGUF."""

    n: int
    qs: torch.Tensor  # (T B, 2048) uint8
    dm: torch.Tensor  # (T B, 256) float16: d at 16 l + i, m at 128 + 16 l + i
    TYPE, KERNEL = "Q4_1", "q4_1_matmul"


@dataclass(frozen=True)
class Q5_0Weight(_Weight):
    """A Q5_0 matrix (N, K) repacked for the kernel: Q4_0Weight's layout for the low 4 bits and d, plus `qh` the fifth
    bits as Q5KWeight's (value (q - 16) d): 22 bytes per 32 weights, as in the GGUF. llama.cpp writes it for the
    matrices of a Q4_K_M file whose rows are not whole 256-blocks (the Qwen2.5 0.5B's)."""

    n: int
    qs: torch.Tensor  # (T B, 2048) uint8
    qh: torch.Tensor  # (T B, 512) uint8
    d: torch.Tensor  # (T B, 128) float16
    TYPE, KERNEL = "Q5_0", "q5_0_matmul"


@dataclass(frozen=True)
class Q5_1Weight(_Weight):
    """A Q5_1 matrix: Q5_0Weight's layout with Q4_1Weight's `dm` (value q d + m): 24 bytes per 32 weights."""

    n: int
    qs: torch.Tensor  # (T B, 2048) uint8
    qh: torch.Tensor  # (T B, 512) uint8
    dm: torch.Tensor  # (T B, 256) float16
    TYPE, KERNEL = "Q5_1", "q5_1_matmul"


@dataclass(frozen=True)
class Q4_0Weight(_Weight):
    """A Q4_0 matrix (N, K) repacked for the kernel: per (tile, 256 weights) `qs` the 4-bit quants as Q4KWeight's (value
    (q - 8) d), `d` the 16 columns' 8 sub-block scales, l-major: 18 bytes per 32 weights, as in the GGUF."""

    n: int
    qs: torch.Tensor  # (T B, 2048) uint8
    d: torch.Tensor  # (T B, 128) float16
    TYPE, KERNEL = "Q4_0", "q4_0_matmul"


Weight = Q4KWeight | Q5KWeight | Q6KWeight | Q8_0Weight | Q4_0Weight | Q4_1Weight | Q5_0Weight | Q5_1Weight


def quantize_activations(x: torch.Tensor) -> Q8KActivations:
    """x (M, K) float32 -> Q8_K rows (ggml's quantize_row_q8_K_ref, bit for bit); K a multiple of 256."""
    if x.dim() != 2 or x.shape[1] % QK:
        raise InvalidArgument(f"activations must be (M, K) with K a multiple of {QK}, got {tuple(x.shape)}")
    return Q8KActivations(kernel().quantize_q8k(x.float()))


def matmul(acts: Q8KActivations, weight: Weight, isa: str | None = None) -> torch.Tensor:
    """(M, K) activations x (N, K) weight^T -> (M, N) float32, any M >= 1 (ROWS_PER_PASS rows per pass over the weight)."""
    code = ISAS[resolve_isa(isa)]
    if acts.records.shape[1] * QK != weight.shape[1]:
        raise InvalidArgument(f"activations have K = {acts.records.shape[1] * QK}, the weight {weight.shape[1]}")
    return getattr(kernel(), weight.KERNEL)(acts.records, *weight.tensors(), weight.n, code)


# ------------------------------------------------------------------------------------------ repacking (pure)
def kernel_order() -> torch.Tensor:
    """(256,) long: the block element that the kernel's byte u holds (u = 32 v + 4 l + t -> element 32 l + 4 v + t)."""
    u = torch.arange(QK)
    return 32 * ((u % 32) // 4) + 4 * (u // 32) + u % 4


def _blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """GGUF tensor bytes (N, B * block_bytes) uint8 -> (N, B, block_bytes)."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % block_bytes:
        raise InvalidArgument(f"expected (N, B * {block_bytes}) uint8 block bytes, got {tuple(raw.shape)} {raw.dtype}")
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:  # (..., 2) uint8 -> (...) float16
    return two_bytes.contiguous().view(torch.float16)[..., 0]


def q4k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 packed bytes (..., 12) -> 8 sub-block scales and 8 mins (6-bit each), as ggml's get_scale_min_k4."""
    s = scales.to(torch.uint8)
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (mix & 0xF) | ((lo >> 6) << 4)], dim=-1)
    mins = torch.cat([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], dim=-1)
    return sc, mins


def q4k_quants(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's 128 quant bytes (..., 128) -> the 256 quants 0..15 in element order."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)  # 64 elements per 32 bytes: low nibbles, then high nibbles
    return torch.cat([chunks & 0xF, chunks >> 4], dim=-2).reshape(*qs.shape[:-1], QK)


def q6k_quants(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Q6_K's ql (..., 128) and qh (..., 64) -> the 256 quants 0..63 in element order (as ggml's dequantize_row_q6_K)."""
    lead = ql.shape[:-1]
    low = ql.reshape(*lead, 2, 1, 64)
    low = torch.cat([low & 0xF, low >> 4], dim=-2).reshape(*lead, 2, 4, 32)  # per half: 4 runs of 32
    high = qh.reshape(*lead, 2, 1, 32)
    high = torch.cat([(high >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)  # (.., 2, 4, 32)
    return (low | (high << 4)).reshape(*lead, QK)


def interleave_q4k(q: torch.Tensor, sc: torch.Tensor, mins: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor):
    """Q4_K's quants (N, B, 256) 0..15 in element order, scales and mins (N, B, 8), d and dmin (N, B) float16, N a
    multiple of TILE -> the kernel's (qs, sm, dd): per (tile, block), line 4 l + h's lane i = column i's weights
    32 l + 4 h + (0..3) in the low nibbles and 32 l + 4 (h + 4) + (0..3) in the high ones; scales l-major; mins as
    (2 p, 2 p + 1) pairs per column; d then dmin."""
    t, b = q.shape[0] // TILE, q.shape[1]
    pairs = mins.reshape(t, TILE, b, 4, 2).permute(0, 2, 3, 1, 4).reshape(t * b, 8 * TILE)
    sm = torch.cat([_by_lane(sc), pairs], dim=1)  # scales, then mins paired for vpdpwssd
    return _nibble_lines(_interleaved_groups(q)), sm, _by_lane(torch.stack([d, dmin], dim=-1))


def repack_q4k(raw: torch.Tensor, chunk_rows: int = 512 * TILE) -> Q4KWeight:
    """A GGUF Q4_K tensor's bytes (N, B * 144) uint8 -> the kernel's layout (zero columns pad N to tiles of 16)."""
    blocks = _blocks(raw, Q4K_BLOCK_BYTES)
    parts = []
    for part in _pad_tiles(blocks).split(chunk_rows):  # chunks hold whole tiles
        sc, mins = q4k_scales(part[..., 4:16])
        parts.append(interleave_q4k(q4k_quants(part[..., 16:144]), sc, mins, _f16(part[..., 0:2]), _f16(part[..., 2:4])))
    return Q4KWeight(blocks.shape[0], *(torch.cat(t).contiguous() for t in zip(*parts)))


def _interleaved_groups(q: torch.Tensor) -> torch.Tensor:
    """(N, B, 256) per-element values, N a multiple of TILE -> (T, B, 8 l, 8 v, 64): group (l, v)'s 4-byte lane i =
    column i's elements 32 l + 4 v + (0..3)."""
    n, b = q.shape[:2]
    return q.reshape(n // TILE, TILE, b, 8, 8, 4).permute(0, 2, 3, 4, 1, 5).reshape(n // TILE, b, 8, 8, 4 * TILE)


def _nibble_lines(groups: torch.Tensor) -> torch.Tensor:
    """(T, B, 8 l, 8 v, 64) values 0..15 -> (T B, 2048): line 4 l + h holds group (l, h) in its low nibbles and group
    (l, h + 4) in its high ones."""
    t, b = groups.shape[:2]
    return (groups[:, :, :, :4] | (groups[:, :, :, 4:] << 4)).reshape(t * b, 2048)


def _by_lane(x: torch.Tensor) -> torch.Tensor:
    """(N, B, X) per-column values, N a multiple of TILE -> (T B, X TILE): per (tile, block), value j of column i at
    j TILE + i (a vector's lane i = column i)."""
    n, b, k = x.shape
    return x.reshape(n // TILE, TILE, b, k).permute(0, 2, 3, 1).reshape(n // TILE * b, k * TILE)


def _pad_tiles(blocks: torch.Tensor) -> torch.Tensor:
    """(N, B, bytes) GGUF blocks -> N padded to a multiple of TILE with zero blocks (their columns come out 0)."""
    extra = -blocks.shape[0] % TILE
    return torch.cat([blocks, blocks.new_zeros(extra, *blocks.shape[1:])]) if extra else blocks


def interleave_q6k(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor):
    """Q6_K's quants (N, B, 256) 0..63 in element order, scales (N, B, 16) int8 and d (N, B) float16, N a multiple of
    TILE -> the kernel's (ql, qh, sc, d): low 4 bits as Q4_K's qs; qh line 2 l + j's byte holds in bits 2c..2c+1 the
    high 2 bits of group (l, 4 j + c)'s same byte; scales s-major."""
    t, b = q.shape[0] // TILE, q.shape[1]
    groups = _interleaved_groups(q)
    high = (groups >> 4).reshape(t, b, 8, 2, 4, 4 * TILE)  # (.., l, j, c, lane)
    qh = (high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)).reshape(t * b, 1024)
    return _nibble_lines(groups & 0xF), qh, _by_lane(sc), _by_lane(d[..., None])


def repack_q6k(raw: torch.Tensor, chunk_rows: int = 512 * TILE) -> Q6KWeight:
    """A GGUF Q6_K tensor's bytes (N, B * 210) uint8 -> the kernel's layout (zero columns pad N to tiles of 16)."""
    blocks = _blocks(raw, Q6K_BLOCK_BYTES)
    parts = []
    for part in _pad_tiles(blocks).split(chunk_rows):  # chunks hold whole tiles
        q = q6k_quants(part[..., 0:128], part[..., 128:192])
        parts.append(interleave_q6k(q, part[..., 192:208].contiguous().view(torch.int8),
                                    part[..., 208:210].contiguous().view(torch.float16)[..., 0]))
    return Q6KWeight(blocks.shape[0], *(torch.cat(t).contiguous() for t in zip(*parts)))


def q5k_high(qh: torch.Tensor) -> torch.Tensor:
    """Q5_K's 32 high-bit bytes (..., 32) -> the 256 fifth bits (0/1) in element order: element 32 s + j is bit s of
    byte j (as ggml's dequantize_row_q5_K)."""
    return torch.stack([(qh >> s) & 1 for s in range(8)], dim=-2).reshape(*qh.shape[:-1], QK)


def interleave_q5k(q: torch.Tensor, sc: torch.Tensor, mins: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor):
    """Q5_K's quants (N, B, 256) 0..31 in element order and Q4_K's other components -> the kernel's (qs, qh, sm, dd):
    Q4_K's layout of the low 4 bits, and qh line l's byte holding in bit v the fifth bit of group (l, v)'s byte."""
    qs, sm, dd = interleave_q4k(q & 0xF, sc, mins, d, dmin)
    groups = _interleaved_groups(q >> 4)  # (T, B, 8 l, 8 v, 64) of 0/1
    qh = sum(groups[:, :, :, v] << v for v in range(8))  # (T, B, 8 l, 64)
    return qs, qh.reshape(-1, 512), sm, dd


def repack_q5k(raw: torch.Tensor, chunk_rows: int = 512 * TILE) -> Q5KWeight:
    """A GGUF Q5_K tensor's bytes (N, B * 176) uint8 -> the kernel's layout (zero columns pad N to tiles of 16)."""
    blocks = _blocks(raw, Q5K_BLOCK_BYTES)
    parts = []
    for part in _pad_tiles(blocks).split(chunk_rows):
        sc, mins = q4k_scales(part[..., 4:16])
        q = q4k_quants(part[..., 48:176]) | (q5k_high(part[..., 16:48]) << 4)
        parts.append(interleave_q5k(q, sc, mins, _f16(part[..., 0:2]), _f16(part[..., 2:4])))
    return Q5KWeight(blocks.shape[0], *(torch.cat(t).contiguous() for t in zip(*parts)))


def _whole_256(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """A 32-weight type's rows (N, K / 32 * block_bytes) -> K padded with zero blocks to a multiple of 256 (d = 0: their
    weights are 0; the runner pads its activations with zero columns the same way, q4_runner.padded): the Qwen2.5
    0.5B's width 896 in a Q8_0 file. The padding costs its share of the reads (896 -> 1024: 14%)."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % block_bytes:
        return raw  # _blocks says what is wrong
    extra = -(raw.shape[1] // block_bytes) % 8
    return torch.cat([raw, raw.new_zeros(raw.shape[0], extra * block_bytes)], dim=1) if extra else raw


def repack_q8_0(raw: torch.Tensor, chunk_rows: int = 512 * TILE) -> Q8_0Weight:
    """A GGUF Q8_0 tensor's bytes (N, K / 32 * 34) uint8 -> the kernel's layout (K padded to a multiple of 256)."""
    blocks = _blocks(_whole_256(raw, Q8_0_BLOCK_BYTES), 8 * Q8_0_BLOCK_BYTES)
    parts = []
    for part in _pad_tiles(blocks).split(chunk_rows):
        sub = part.reshape(*part.shape[:2], 8, Q8_0_BLOCK_BYTES)  # (N, B, 8 sub-blocks, 34)
        q = sub[..., 2:].reshape(*part.shape[:2], QK)  # (N, B, 256) the int8 quants' bytes, element order
        parts.append((_interleaved_groups(q).reshape(-1, 4096), _by_lane(_f16(sub[..., 0:2]))))
    return Q8_0Weight(blocks.shape[0], *(torch.cat(t).contiguous() for t in zip(*parts)))


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """Q4_0 / Q4_1's 16 quant bytes (..., 16) -> the 32 quants 0..15 in element order (j low, j + 16 high)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def repack_q4_0(raw: torch.Tensor, chunk_rows: int = 512 * TILE) -> Q4_0Weight:
    """A GGUF Q4_0 tensor's bytes (N, K / 32 * 18) uint8 -> the kernel's layout (K padded to a multiple of 256)."""
    blocks = _blocks(_whole_256(raw, Q4_0_BLOCK_BYTES), 8 * Q4_0_BLOCK_BYTES)
    parts = []
    for part in _pad_tiles(blocks).split(chunk_rows):
        sub = part.reshape(*part.shape[:2], 8, Q4_0_BLOCK_BYTES)  # (N, B, 8 sub-blocks, 18)
        q = _nibbles_32(sub[..., 2:]).reshape(*part.shape[:2], QK)
        parts.append((_nibble_lines(_interleaved_groups(q)), _by_lane(_f16(sub[..., 0:2]))))
    return Q4_0Weight(blocks.shape[0], *(torch.cat(t).contiguous() for t in zip(*parts)))



def repack_q4_1(raw: torch.Tensor, chunk_rows: int = 512 * TILE) -> Q4_1Weight:
    """A GGUF Q4_1 tensor's bytes (N, K / 32 * 20) uint8 -> the kernel's layout (K padded to a multiple of 256)."""
    blocks = _blocks(_whole_256(raw, Q4_1_BLOCK_BYTES), 8 * Q4_1_BLOCK_BYTES)
    parts = []
    for part in _pad_tiles(blocks).split(chunk_rows):
        sub = part.reshape(*part.shape[:2], 8, Q4_1_BLOCK_BYTES)  # (N, B, 8 sub-blocks, 20)
        q = _nibbles_32(sub[..., 4:]).reshape(*part.shape[:2], QK)
        dm = torch.cat([_by_lane(_f16(sub[..., 0:2])), _by_lane(_f16(sub[..., 2:4]))], dim=1)
        parts.append((_nibble_lines(_interleaved_groups(q)), dm))
    return Q4_1Weight(blocks.shape[0], *(torch.cat(t).contiguous() for t in zip(*parts)))



def _fifth_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's 4 high-bit bytes (..., 4) -> the 32 fifth bits (0/1) in element order: element e is bit e of the
    little-endian 32-bit word (as ggml's dequantize_row_q5_0)."""
    return torch.stack([(qh >> s) & 1 for s in range(8)], dim=-1).reshape(*qh.shape[:-1], 32)


def _repack_5bit(raw: torch.Tensor, block_bytes: int, with_m: bool, chunk_rows: int):
    blocks = _blocks(_whole_256(raw, block_bytes), 8 * block_bytes)
    parts, at = [], 4 if with_m else 2  # where qh starts in a block
    for part in _pad_tiles(blocks).split(chunk_rows):
        sub = part.reshape(*part.shape[:2], 8, block_bytes)  # (N, B, 8 sub-blocks, bytes)
        q = _nibbles_32(sub[..., at + 4 :]) | (_fifth_bits_32(sub[..., at : at + 4]) << 4)
        groups = _interleaved_groups(q.reshape(*part.shape[:2], QK))  # (T, B, 8 l, 8 v, 64) 0..31
        qh = sum((groups[:, :, :, v] >> 4) << v for v in range(8)).reshape(-1, 512)
        scales = _by_lane(_f16(sub[..., 0:2]))
        if with_m:
            scales = torch.cat([scales, _by_lane(_f16(sub[..., 2:4]))], dim=1)
        parts.append((_nibble_lines(groups & 0xF), qh, scales))
    return blocks.shape[0], [torch.cat(t).contiguous() for t in zip(*parts)]


def repack_q5_0(raw: torch.Tensor, chunk_rows: int = 512 * TILE) -> Q5_0Weight:
    """A GGUF Q5_0 tensor's bytes (N, K / 32 * 22) uint8 -> the kernel's layout (K padded to a multiple of 256)."""
    n, tensors = _repack_5bit(raw, Q5_0_BLOCK_BYTES, False, chunk_rows)
    return Q5_0Weight(n, *tensors)


def repack_q5_1(raw: torch.Tensor, chunk_rows: int = 512 * TILE) -> Q5_1Weight:
    """A GGUF Q5_1 tensor's bytes (N, K / 32 * 24) uint8 -> the kernel's layout (K padded to a multiple of 256)."""
    n, tensors = _repack_5bit(raw, Q5_1_BLOCK_BYTES, True, chunk_rows)
    return Q5_1Weight(n, *tensors)


WEIGHTS = {cls.TYPE: cls for cls in (Q4KWeight, Q5KWeight, Q6KWeight, Q8_0Weight, Q4_0Weight, Q4_1Weight, Q5_0Weight,
                                      Q5_1Weight)}
MATRIX_TYPES = tuple(WEIGHTS)  # the GGML types the kernel runs
REPACK = {"Q4_K": repack_q4k, "Q5_K": repack_q5k, "Q6_K": repack_q6k, "Q8_0": repack_q8_0,
          "Q4_0": repack_q4_0, "Q4_1": repack_q4_1, "Q5_0": repack_q5_0, "Q5_1": repack_q5_1}


def row_multiple(type_name: str) -> int:
    """What K (a matrix's row length) must be a multiple of in a GGUF of this type for the kernel to run it: 256 for the
    K-quants, 32 for the 32-weight types (padded with zero blocks at repacking)."""
    return 32 if type_name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1") else QK


def unsupported(type_name: str, what: str = "a matrix") -> str:
    """The error for a type the kernel cannot run: it is never converted to another one (that would not be the
    user's model); llama.cpp runs it."""
    return (f"{what} is {type_name}: the osd kernel runs {', '.join(MATRIX_TYPES)} matrices, not {type_name} (it does "
            "not convert one type into another); use --target-backend llama.cpp for this file")


def repack(raw: torch.Tensor, type_name: str) -> Weight:
    """GGUF tensor bytes of one of MATRIX_TYPES -> the kernel's weight."""
    if type_name not in REPACK:
        raise InvalidArgument(unsupported(type_name))
    return REPACK[type_name](raw)


def from_tensors(type_name: str, n: int, tensors: list[torch.Tensor]) -> Weight:
    """A repacked weight from its type, N and tensors (`tensors()`), as stored."""
    return WEIGHTS[type_name](n, *tensors)


def load_gguf_weight(path: str | Path, name: str) -> Weight:
    """One kernel-type tensor of a GGUF file (e.g. 'blk.0.ffn_up.weight'), repacked. The file is memory-mapped."""
    from gguf import GGUFReader

    for t in GGUFReader(str(path)).tensors:
        if t.name == name:
            return repack(torch.from_numpy(t.data.copy()), t.tensor_type.name)
    raise InvalidArgument(f"no tensor {name!r} in {path}")
