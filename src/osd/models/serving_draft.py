"""Cheap serving copies of a draft model (speed tricks, each optional and explained).

- int8: int8 weights for every nn.Linear. Decoding a 0.5B draft is memory-bandwidth bound on CPU: int8
  weights move 4x fewer bytes than fp32, so a draft step costs a fraction of the fp32 one. With our
  rows_linear_int8 kernel (models/kernels.py) the weights are int8 with one scale per output row and the
  activations stay fp32 (weight-only); without it, torch's dynamic int8 quantisation (activations
  quantised on the fly too). The draft's precision only changes acceptance, never the output (the
  target verifies every token).
- draft_vocab=N: the LM head keeps only token ids < N plus the special tokens (a derived draft, models/derived.py,
  brings its own vocabulary map instead). Qwen2.5's BPE ids
  are roughly in merge (frequency) order, so low ids cover nearly all text; the LM head over the
  full 151,936-token vocabulary is ~27% of a 0.5B draft's per-token work.
The master weights stay untouched (the learner trains them); these copies are rebuilt on publish.
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from osd.errors import InvalidArgument
from osd.models.kernels import MAX_ROWS_INT8, rows_linear_int8


def truncate_lm_head(model, draft_vocab: int, keep_ids: list[int]) -> torch.Tensor:
    """Replace the LM head by one over ids < draft_vocab plus keep_ids; return the (N,) id map."""
    head = model.get_output_embeddings()
    vocab_ids = torch.tensor(sorted(set(range(min(draft_vocab, head.weight.shape[0]))) | set(keep_ids)), dtype=torch.long)
    small = nn.Linear(head.weight.shape[1], len(vocab_ids), bias=head.bias is not None, dtype=head.weight.dtype)
    small.weight = nn.Parameter(head.weight.detach()[vocab_ids].clone(), requires_grad=False)
    if head.bias is not None:
        small.bias = nn.Parameter(head.bias.detach()[vocab_ids].clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(small)
    return vocab_ids


class Int8Linear(nn.Module):
    """Weight-only int8 linear, one symmetric scale per output row; 1-4 rows through the kernel."""

    def __init__(self, linear: nn.Linear, kernel):
        super().__init__()
        weight = linear.weight.detach().float()  # (N, K)
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # (N,)
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.kernel, self.in_features, self.out_features = kernel, linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, self.in_features)  # (M, K)
        if rows <= MAX_ROWS_INT8:
            out = self.kernel(flat, self.weight_int8, self.scale, self.bias)  # (M, N)
        else:  # a prompt's prefill: dequantise this layer once for the whole block
            out = torch.mm(flat, self.weight_int8.t().float()) * self.scale
            out = out + self.bias if self.bias is not None else out
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_int8(model):
    """int8 weights for all nn.Linear layers (in place): weight-only with our kernel, else torch's dynamic int8."""
    kernel = rows_linear_int8()
    if kernel is not None:
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, name, Int8Linear(child, kernel))
        model.config.tie_word_embeddings = False
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)


def make_serving_draft(master, quantize: str = "none", draft_vocab: int = 0, keep_ids: list[int] = ()):
    """Return (serving_model, vocab_ids or None): a frozen, possibly quantised/truncated copy."""
    from osd.learn.trainable import merge_lora

    from osd.models.vocab_map import vocab_ids_of

    model = copy.deepcopy(master).float().eval().requires_grad_(False)
    merge_lora(model)  # a LoRA-trained master serves as a plain model
    vocab_ids = vocab_ids_of(model)  # a derived draft's own vocabulary map (models/derived.py), else None
    if draft_vocab:
        if vocab_ids is not None:
            raise InvalidArgument("this draft's LM head already covers a vocabulary map (a derived draft): "
                                  "leave draft_vocab at 0")
        vocab_ids = truncate_lm_head(model, draft_vocab, list(keep_ids))
    if quantize == "int8":
        model = quantize_int8(model)
    return model, vocab_ids
