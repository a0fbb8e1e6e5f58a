"""A Hugging Face (torch) target quantized at load: weight-only int8 (opt-in, ModelConfig.target_quantize).

Why: decoding reads every weight once per step, so an fp32 target moves 4x the bytes of an int8 one (the bundled
1.5B: ~7 GB vs ~1.8 GB per token). `quantize_target(model, "int8")` replaces every nn.Linear by the draft's
Int8Linear (models/serving_draft.py: int8 weights, one symmetric scale per output row, fp32 activations, our
rows_linear_int8 kernel), makes the input embedding int8 too (sharing the LM head's rows where they are tied, as
Qwen2.5 ties them), and installs the row-invariant attention and SiLU (models/invariant.py). The model is changed
in place and each float matrix is dropped as soon as its int8 copy exists: once serving starts no float matrix of
the target is left (only 1-D tensors: norms, biases, scales); a bf16 target's remaining tensors become fp32.

Greedy identity: the speculative path and osd's target-only path run the same quantized model through the same
kernels, and a position's logits do not depend on the number of rows verified with it, so greedy output is the
same at every k. It is the int8 target's output, not the fp32 target's: `osd bench target-quant` reports how
often they agree (bench/target_quant.py).

Limitations: int8 only (no 4-bit for torch targets: a Q4 GGUF serves 4-bit, --target-backend osd / llama.cpp, and
a GGUF on those backends is refused here); layers other than nn.Linear / nn.Embedding (e.g. GPT-2's Conv1D) are
not converted, which is an error rather than a silent fp32 leftover. Without the compiled kernels:
KernelUnavailable, or where a fallback is allowed torch's dynamic int8 (activations quantized too, not
row-invariant, the embedding stays float; recorded in kernels.status()).
"""
from __future__ import annotations

import gc

from osd.errors import InvalidArgument
from osd.memory import trim
from osd.models import kernels
from osd.models.serving_draft import quantize_int8

FALLBACK_USE = "target int8 linears: torch dynamic int8"


def float_matrices(model) -> list[str]:
    """Names of the model's floating-point parameters and buffers with 2 or more dimensions (weight matrices)."""
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return [name for name, t in tensors if t is not None and t.is_floating_point() and t.dim() >= 2]


def quantize_target(model, how: str = "int8", allow_fallback: bool = False):
    """Quantize a frozen torch target in place ("none": unchanged) and return it. See the module docstring."""
    if how == "none":
        return model
    if how != "int8":
        raise InvalidArgument(f"target quantization must be none or int8, got {how!r}")
    module = kernels.load(allow_fallback, use=FALLBACK_USE)
    if module is None:  # torch's dynamic int8 takes float32 linears only
        _to_float32(model)
    quantize_int8(model, allow_fallback, use=FALLBACK_USE)
    _to_float32(model)  # what is left (norms, biases): the compiled attention runs float32 only
    model.eval().requires_grad_(False)
    leftover = float_matrices(model) if module is not None else []
    if leftover:
        raise InvalidArgument(f"int8 quantization converts nn.Linear and nn.Embedding layers; this model keeps float "
                              f"matrices in {', '.join(leftover[:3])}: serve it unquantized (--target-quantize none)")
    gc.collect()
    trim()  # the float matrices just freed go back to the system
    return model


def _to_float32(model) -> None:
    """Give every other floating-point parameter / buffer a new float32 tensor. Unlike model.float(), which
    converts a Parameter in place, this leaves alone a model sharing them (build.py's prepack_copy)."""
    import torch
    from torch import nn

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_floating_point() and p.dtype != torch.float32:
                module._parameters[name] = nn.Parameter(p.detach().float(), requires_grad=False)
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_floating_point() and b.dtype != torch.float32:
                module._buffers[name] = b.float()


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (each storage counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total
