"""The learner's compute precision: bf16 matrix products where the CPU does them natively, fp32 elsewhere.

A distillation step of the cheap draft's last layer is matrix products (the layer's projections and MLP, the LM
head at the supervised positions) forward and backward. On a CPU with native bf16 dot products (AVX-512 BF16,
AMX) they run about twice as fast under bf16 autocast, the weights, gradients and Adam moments staying fp32:
on the Zen 4 machine a batch of 2 code items (64 supervised positions each) took 90 ms forward + backward against
172 ms in fp32, gradients within 1.3% of the fp32 ones (relative L2;
benchmarks/learning/bench-train-step-code-b2.json), and a draft learnt on 300 code requests reached the same held-out
acceptance (0.529 against 0.530, benchmarks/learning/precision-code300-{bf16,fp32}.json). Without native bf16
(AVX2-only) bf16 is emulated and slower, so "auto" stays fp32 there.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from osd.errors import InvalidArgument
from osd.models.kernels import cpu_flags

PRECISIONS = ("auto", "float32", "bfloat16")


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX BF16), from its /proc/cpuinfo flags."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def training_dtype(precision: str, native: bool | None = None) -> torch.dtype:
    """The dtype of the learner's matrix products: `precision` as asked, or for "auto" bf16 where `native`
    (default: this CPU's `native_bf16()`), else fp32."""
    if precision not in PRECISIONS:
        raise InvalidArgument(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return torch.bfloat16 if (native_bf16() if native is None else native) else torch.float32
    return torch.bfloat16 if precision == "bfloat16" else torch.float32


def compute_in(dtype: torch.dtype):
    """A context that runs the forward pass's matrix products in `dtype` (autocast; nothing for fp32)."""
    return torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else nullcontext()
