"""Fast, row-invariant fp32 linears for CPU decoding and verification (the target's serving copy).

Decoding multiplies 1 row (a target-only step) and verification k+1 rows (2-9) by each weight. Both are
memory-bound: the ideal cost is one read of the weight, whatever the row count. Measured here (2-core
AVX2, torch 2.13, one 8960x1536 fp32 weight, ms; the machine is noisy, ratios are what count):

    rows                                  1     2     5     8
    F.linear (x @ W^T, torch default)   4.1   7.3  18.5  21.7   repacks W on every call
    oneDNN prepacked (MkldnnLinear)     2.8   5.7   6.9   7.9   a fast gemv, ~2x for 2+ rows
    W @ x^T (MKL, dense W)              3.8   3.7   4.5   6.2
    rows_linear (models/kernels.py)     2.9   3.0   3.5   4.7   one pass over W, rows in registers

The row-invariant rows_linear (one fixed order per row, any row count) measured within noise of the
per-row-count kernel it replaced (1 thread, thread CPU time, best of 20, same weight: 1/2/5/8 rows
2.83/2.94/8.10/10.1 ms vs 2.91/2.97/7.94/10.7 ms).

`FastLinear` runs every row count through rows_linear, on the dense weight it shares with the original
linear (no extra memory), and `prepack_linears` also installs the row-invariant attention and SiLU
(models/invariant.py): a position's logits are then bitwise independent of the number of rows verified
with it, so greedy output cannot depend on the k a policy chose. They differ from torch's dense path by
~1e-5 (float summation order), so greedy output can differ from a plain torch run at exact near-ties;
`osd bench speed` reports whether outputs matched. Prefill runs through the same kernel: as fast as
torch.mm for short rows (K = 896), up to ~2x slower for long ones (K = 4864; no K blocking).
Without the compiled kernels `prepack_linears` raises KernelUnavailable unless a fallback is allowed; the
fallback is oneDNN's prepacked copy (fast for one row, a second copy of the weights, not row-invariant).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from osd.models import kernels
from osd.models.invariant import make_row_invariant


class FastLinear(nn.Module):
    """A frozen fp32 nn.Linear through the compiled rows_linear kernel (any number of rows, row-invariant)."""

    def __init__(self, linear: nn.Linear, kernel):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)  # (N, K), storage shared with `linear`
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.kernel = kernel
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (M, K)
        return self.kernel(flat, self.weight, self.bias).reshape(*x.shape[:-1], self.out_features)  # (..., N)


def prepack_linears(model, allow_fallback: bool = False) -> int:
    """Replace every float32 nn.Linear of a frozen model by a fast one and make its attention and SiLU
    row-invariant (in place). Returns the count of linears. Without the compiled kernels: KernelUnavailable,
    or with `allow_fallback` oneDNN's linears (recorded in kernels.status())."""
    module = kernels.load(allow_fallback, use="target fp32 linears: oneDNN")
    if module is None and not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                setattr(parent, name, FastLinear(child, module.rows_linear) if module else _onednn_linear(child))
                count += 1
    if count:
        model.config.tie_word_embeddings = False  # the LM head is its own module now
    if module is not None:
        make_row_invariant(model, module)
    return count


def _onednn_linear(linear: nn.Linear) -> nn.Module:
    from torch.utils.mkldnn import MkldnnLinear

    return MkldnnLinear(linear, torch.float32)


def shared_weights_copy(model):
    """A copy of the module tree that shares every parameter and buffer with `model` (no extra memory)."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)
