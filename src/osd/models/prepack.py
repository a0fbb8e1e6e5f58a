"""Fast fp32 linears for CPU decoding and verification (speed trick, optional, exact up to float rounding).

Decoding multiplies 1 row (a target-only step) and verification k+1 rows (2-9) by each weight. Both are
memory-bound: the ideal cost is one read of the weight, whatever the row count. Measured here (2-core
AVX2, torch 2.13, one 8960x1536 fp32 weight, ms; the machine is noisy, ratios are what count):

    rows                                  1     2     5     8
    F.linear (x @ W^T, torch default)   4.1   7.3  18.5  21.7   repacks W on every call
    oneDNN prepacked (MkldnnLinear)     2.8   5.7   6.9   7.9   a fast gemv, ~2x for 2+ rows
    W @ x^T (MKL, dense W)              3.8   3.7   4.5   6.2
    rows_linear (models/kernels.py)     2.9   3.0   3.5   4.7   one pass over W, 8 rows in registers

`FastLinear` runs 1-8 rows through rows_linear and more (prefill) through W @ x^T, on the dense weight
it shares with the original linear (no extra memory). Where the kernel cannot be built, the fallback is
oneDNN's prepacked copy (fast for one row, a second copy of the weights). Logits differ from the dense
path by ~1e-5 (float summation order), so greedy output can differ from a dense-kernel run only at exact
near-ties; `osd bench speed` reports whether outputs matched.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from osd.models.kernels import MAX_ROWS, rows_linear


def prepack_available() -> bool:
    return rows_linear() is not None or torch.backends.mkldnn.is_available()


class FastLinear(nn.Module):
    """A frozen fp32 nn.Linear that picks the fastest CPU kernel per row count (table above)."""

    def __init__(self, linear: nn.Linear, kernel):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)  # (N, K), storage shared with `linear`
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.kernel = kernel
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, self.in_features)  # (M, K)
        if rows <= MAX_ROWS:
            out = self.kernel(flat, self.weight, self.bias)  # (M, N)
        else:
            out = torch.mm(self.weight, flat.t()).t()  # (N, K) @ (K, M) -> (M, N) view
            out = out + self.bias if self.bias is not None else out.contiguous()
        return out.reshape(*x.shape[:-1], self.out_features)


def prepack_linears(model) -> int:
    """Replace every float32 nn.Linear of a frozen model by a fast one. Returns the count."""
    kernel = rows_linear()
    if kernel is None and not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                setattr(module, name, FastLinear(child, kernel) if kernel else _onednn_linear(child))
                count += 1
    if count:
        model.config.tie_word_embeddings = False  # the LM head is its own module now
    return count


def _onednn_linear(linear: nn.Linear) -> nn.Module:
    from torch.utils.mkldnn import MkldnnLinear

    return MkldnnLinear(linear, torch.float32)


def shared_weights_copy(model):
    """A copy of the module tree that shares every parameter and buffer with `model` (no extra memory)."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)
