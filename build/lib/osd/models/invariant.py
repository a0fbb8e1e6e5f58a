"""Row-invariant attention and SiLU for the serving copies (prepacked target, int8 draft): with the fast
linears of models/prepack.py and models/serving_draft.py, a position's logits are bitwise the same whether
the position was fed alone or with the other rows of a verification step (greedy identity by construction).

Why: in torch's own paths the result of a row depends on how many rows are computed together. Measured on
a Qwen2 layer with each linear applied row by row (torch 2.13, CPU): sdpa and eager attention give a row
different last bits in a 1-row and a 2..9-row step (the matmuls and softmax are split by the sizes), and
torch's SiLU computes the tail of each parallel chunk with scalar code whose results differ from its vector
code (170 of 4096 values); the chunks depend on the element count and the thread count. RMSNorm, RoPE
(head sizes that are multiples of 32), residual adds and the embedding were row-invariant there.

`make_row_invariant(model, module)` routes attention through the compiled `attention_rows` (registered with
transformers as the "osd_rows" attention) and SiLU activations through `silu_rows` (models/rows_linear.cpp).
Limitations: the compiled attention serves one unpadded sequence (batch 1, float32, no sliding window, the
queries being the last positions, as CachedModel feeds them); anything else (the batched padded generation
of osd distill, sliding-window layers) goes through transformers' sdpa unchanged, so is not row-invariant.
"""
from __future__ import annotations

import torch
from torch import nn

ATTENTION = "osd_rows"
_kernels = {}  # the compiled module, set by make_row_invariant


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs):
    """transformers attention interface: query (B, H, T, D), key/value (B, Hkv, L, D) -> ((B, T, H, D), None)."""
    if (attention_mask is None and query.shape[0] == 1 and not sliding_window and dropout == 0.0
            and query.dtype == torch.float32 and not kwargs.get("output_attentions")):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return _kernels["module"].attention_rows(query[0], key[0], value[0], float(scale)).unsqueeze(0), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  sliding_window=sliding_window, **kwargs)


def _mask(batch_size, cache_position, kv_length, kv_offset=0, mask_function=None, attention_mask=None,
          allow_is_causal_skip=True, **kwargs):
    """None (plain causal: the compiled attention) for one unpadded sequence whose queries are its last
    positions; otherwise sdpa's mask (then _attention hands the call to sdpa)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = mask_function or causal_mask_function
    queries = cache_position.shape[0]
    if (allow_is_causal_skip and batch_size == 1 and kv_offset == 0 and mask_function is causal_mask_function
            and queries <= kv_length and int(cache_position[0]) == kv_length - queries
            and int(cache_position[-1]) == kv_length - 1 and (attention_mask is None or bool(attention_mask.all()))):
        return None
    return sdpa_mask(batch_size, cache_position, kv_length, kv_offset, mask_function, attention_mask,
                     allow_is_causal_skip=allow_is_causal_skip, **kwargs)


class RowSiLU(nn.Module):
    """silu(x) through the compiled kernel: every element by the same code, whatever the tensor's size."""

    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x) if x.dtype == torch.float32 else nn.functional.silu(x)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _mask)


def make_row_invariant(model, module) -> bool:
    """Install the compiled attention and SiLU in a frozen model (in place). Returns whether its attention
    is now the compiled one (False for models without transformers' attention interface)."""
    from transformers.activations import SiLUActivation

    _kernels["module"] = module
    _register()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (SiLUActivation, nn.SiLU):
                setattr(parent, name, RowSiLU(module.silu_rows))
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION)
    return getattr(model.config, "_attn_implementation", None) == ATTENTION
