"""Fast fp32 linears for CPU decoding and verification (speed trick, optional, exact up to float rounding).

Decoding multiplies 1 row (a target-only step) and verification k+1 rows (2-9) by each weight. Both are
memory-bound: the ideal cost is one read of the weight, whatever the row count. Measured here (2-core
AVX2, torch 2.13, one 8960x1536 fp32 weight, ms):

    rows                      1     2     5
    F.linear (x @ W^T)      4.1   7.3  18.5    torch's default: repacks W on every call
    oneDNN prepacked        2.8   5.7   6.9    fastest for 1 row, ~2x for 2+ rows
    W @ x^T (dense W)       3.8   3.7   4.5    MKL's tall-skinny product reads W once

So `FastLinear` keeps both: one row goes through oneDNN's prepacked copy, 2..max_rows rows through
W @ x^T on the dense weight (a five-token verification of Qwen2.5-1.5B: 787 ms -> ~500 ms). The price
is memory: the dense and the packed copy of each weight (2x the target's fp32 size). Logits differ from
the dense path by ~1e-5 (float summation order), so greedy output can differ from a dense-kernel run
only at exact near-ties; `osd bench speed` reports whether outputs matched.
"""
from __future__ import annotations

import torch
from torch import nn


def prepack_available() -> bool:
    return torch.backends.mkldnn.is_available()


class FastLinear(nn.Module):
    """A frozen fp32 nn.Linear with the fastest CPU kernel per row count (table above)."""

    def __init__(self, linear: nn.Linear, max_rows: int = 32):
        from torch.utils.mkldnn import MkldnnLinear

        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)  # (N, K) dense, shared with `linear`
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.packed = MkldnnLinear(linear, torch.float32)
        self.max_rows = max_rows
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows == 1 or rows > self.max_rows:
            return self.packed(x)
        out = torch.mm(self.weight, x.reshape(rows, -1).t()).t()  # (N, K) @ (K, rows) -> (rows, N), a view
        out = out + self.bias if self.bias is not None else out.contiguous()
        return out.reshape(*x.shape[:-1], self.out_features)


def prepack_linears(model) -> int:
    """Replace every float32 nn.Linear in a frozen model by a FastLinear. Returns the count."""
    if not prepack_available():
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                setattr(module, name, FastLinear(child))
                count += 1
    if count:
        model.config.tie_word_embeddings = False  # the LM head now holds its own packed copy
    return count
