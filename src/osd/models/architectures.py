"""What each model family the osd Q4 backend runs needs, chosen from a GGUF's `general.architecture` (never guessed).

One frozen `Architecture` per family, the conventions of llama.cpp (src/llama-model.cpp, src/models/<arch>.cpp) and
of its converter (convert_hf_to_gguf.py), which wrote the files:

  family   RoPE    scaling                    biases  q/k norm  embed x   MLP         extra norms      windows
  qwen2    neox    -                          q/k/v   -         1         SiLU        -                -
  llama    normal  rope_freqs tensor (Llama   -       -         1         SiLU        -                -
                   3), linear factor
  qwen3    neox    -                          -       per head  1         SiLU        -                -
  gemma3   neox    linear factor (global      -       per head  sqrt(h)   GELU-tanh   post-attention,  5 local (base
                   layers only)                                                       post-ffn         10000) : 1 global

RoPE "normal" rotates adjacent pairs (2i, 2i + 1), "neox" pairs (i, i + D/2). llama.cpp's converter permutes a Llama's
q/k rows (`LlamaModel.permute`: per head, (2, D/2) -> (D/2, 2)) so that llama.cpp's normal RoPE on the file computes
what transformers' rotate-half RoPE computes on the original weights. The runner undoes that permutation when it
loads the file (a quantized matrix's rows are whole units, so permuting them is exact) and runs its one NEOX RoPE:
`unpermute_rows`.

Gemma 3: the converter stores every RMSNorm weight as 1 + w (Gemma3RMSNorm multiplies by 1 + w; `norm_shift`), so
the file's norms are used as they are; a sliding layer attends to its last `sliding_window` positions (the query's
own included: llama.cpp's LLAMA_SWA_TYPE_STANDARD, transformers' `kv_idx > q_idx - window`); layer i is global when
(i + 1) % 6 == 0 (llama.cpp's `set_swa_pattern(6)`; a file without `gemma3.attention.sliding_window` has none); the
attention scale is 1/sqrt(head dim), 1/sqrt(hidden / heads) for the 62-layer 27B (llama.cpp's rule: the file holds no
query_pre_attn_scalar); no final logit softcapping (gemma2 had it: a file that sets it is refused).

Anything else (gemma2's logit softcapping, phi3, mistral's sliding windows, MoE, ...) is refused with the family's
name: the `auto` target backend then serves the file on llama.cpp.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from osd.errors import InvalidArgument


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    rope: str  # "neox": pairs (i, i + D/2); "normal": adjacent pairs (llama.cpp's converter permuted q/k rows)
    rope_freqs: bool  # a `rope_freqs.weight` tensor (D/2) may divide the frequencies (Llama 3's scaling)
    rope_scalings: tuple[str, ...]  # `{arch}.rope.scaling.type` values accepted besides none ("linear")
    qkv_bias: bool  # attn_q/k/v.bias may be present (else their presence is refused)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (attn_q_norm / attn_k_norm, (D,) each)
    embed_scale: bool  # token embeddings times sqrt(hidden)
    activation: str  # "silu" or "gelu_tanh": act(gate) * up
    post_norms: bool  # RMSNorm of the attention and feed-forward outputs before their residual adds
    swa_pattern: int = 0  # 0: every layer global; n: layer i slides unless (i + 1) % n == 0
    swa_rope_base: float = 10000.0  # RoPE base of the sliding layers (no scaling there)


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("qwen2", rope="neox", rope_freqs=False, rope_scalings=(), qkv_bias=True, qk_norm=False,
                 embed_scale=False, activation="silu", post_norms=False),
    Architecture("llama", rope="normal", rope_freqs=True, rope_scalings=("linear",), qkv_bias=False, qk_norm=False,
                 embed_scale=False, activation="silu", post_norms=False),
    Architecture("qwen3", rope="neox", rope_freqs=False, rope_scalings=(), qkv_bias=False, qk_norm=True,
                 embed_scale=False, activation="silu", post_norms=False),
    Architecture("gemma3", rope="neox", rope_freqs=False, rope_scalings=("linear",), qkv_bias=False, qk_norm=True,
                 embed_scale=True, activation="gelu_tanh", post_norms=True, swa_pattern=6, swa_rope_base=10000.0),
)}
FALLBACK = "llama.cpp"  # what serves a GGUF of any other family (the auto backend; --target-backend llama.cpp)


def architecture(name: str) -> Architecture:
    """The family's entry, or InvalidArgument naming it and the fallback."""
    if name not in ARCHITECTURES:
        raise InvalidArgument(f"the osd Q4 backend runs {', '.join(ARCHITECTURES)} GGUFs; this one is {name!r} "
                              f"(served on {FALLBACK} instead: --target-backend {FALLBACK}, or auto)")
    return ARCHITECTURES[name]


def sliding(arch: Architecture, layer: int) -> bool:
    """Whether `layer` attends within the sliding window (llama.cpp's swa pattern: every n-th layer is global)."""
    return arch.swa_pattern > 0 and (layer + 1) % arch.swa_pattern != 0


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """(rows,) int64 index: file row of each original row of a q or k matrix (or bias) the llama converter permuted
    (`w.reshape(heads, 2, D/2, K).swapaxes(1, 2)`): original row h D + t D/2 + j sits at file row h D + 2 j + t."""
    d = rows // heads
    if d * heads != rows or d % 2:
        raise InvalidArgument(f"{rows} q/k rows do not split into {heads} heads of an even size")
    h, t, j = torch.meshgrid(torch.arange(heads), torch.arange(2), torch.arange(d // 2), indexing="ij")  # (H, 2, D/2)
    return (h * d + 2 * j + t).reshape(-1)
