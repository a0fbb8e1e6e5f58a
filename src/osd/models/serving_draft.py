"""Cheap serving copies of a draft model (speed tricks, each optional and explained).

- int8: int8 weights for every nn.Linear. Decoding a 0.5B draft is memory-bandwidth bound on CPU: int8
  weights move 4x fewer bytes than fp32, so a draft step costs a fraction of the fp32 one. With our
  rows_linear_int8 kernel (models/kernels.py) the weights are int8 with one scale per output row and the
  activations stay fp32 (weight-only); without it, torch's dynamic int8 quantisation (activations
  quantised on the fly too). The draft's precision only changes acceptance, never the output (the
  target verifies every token).
- draft_vocab=N: the LM head keeps only token ids < N plus the special tokens. Qwen2.5's BPE ids
  are roughly in merge (frequency) order, so low ids cover nearly all text; the LM head over the
  full 151,936-token vocabulary is ~27% of a 0.5B draft's per-token work.
- the int8 copy's embedding is int8 too (per-row scale), and shares the LM head's int8 rows when the head covers
  the whole vocabulary (Qwen2.5 ties them): the serving copy holds no fp32 matrix at all.
The master weights stay untouched (the learner trains them); these copies are rebuilt on publish, without a
transient fp32 copy of the whole draft (only tensors the copy keeps are cloned).
"""
from __future__ import annotations

import copy
import itertools
import warnings

import torch
from torch import nn

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
        self.source_weight_id = id(linear.weight)  # which float matrix it came from (to detect a tied embedding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, self.in_features)  # (M, K)
        if rows <= MAX_ROWS_INT8:
            out = self.kernel(flat, self.weight_int8, self.scale, self.bias)  # (M, N)
        else:  # a prompt's prefill: dequantise this layer once for the whole block
            out = torch.mm(flat, self.weight_int8.t().float()) * self.scale
            out = out + self.bias if self.bias is not None else out
        return out.reshape(*x.shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """Embedding rows stored int8 with one symmetric scale per row (the layout of Int8Linear's weight)."""

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("weight_int8", weight_int8)  # (V, H)
        self.register_buffer("scale", scale)  # (V,)

    @classmethod
    def from_float(cls, embedding: nn.Embedding) -> "Int8Embedding":
        weight = embedding.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        return cls(torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_int8[ids].float() * self.scale[ids].unsqueeze(-1)  # (..., H)


def _quantize_embedding(model) -> None:
    """int8 input embedding, sharing the int8 LM head's rows where the head covers the same vocabulary."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(head, Int8Linear) and head.source_weight_id == id(embedding.weight):
        model.set_input_embeddings(Int8Embedding(head.weight_int8, head.scale))
    else:
        model.set_input_embeddings(Int8Embedding.from_float(embedding))


def quantize_int8(model):
    """int8 weights for all nn.Linear layers (in place): weight-only with our kernel, else torch's dynamic int8."""
    kernel = rows_linear_int8()
    if kernel is not None:
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, name, Int8Linear(child, kernel))
        _quantize_embedding(model)
        model.config.tie_word_embeddings = False
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)


def make_serving_draft(master, quantize: str = "none", draft_vocab: int = 0, keep_ids: list[int] = ()):
    """Return (serving_model, vocab_ids or None): a frozen, possibly quantised/truncated copy.

    The copy starts by sharing every master tensor (no transient fp32 copy of the draft); quantisation and
    truncation replace the big ones with new tensors, and whatever is still shared at the end is cloned, so
    later updates of the master never reach a published copy.
    """
    from osd.learn.trainable import merge_lora

    shared = {id(t): t for t in itertools.chain(master.parameters(), master.buffers())}
    model = copy.deepcopy(master, dict(shared))
    merge_lora(model)  # a LoRA-trained master serves as a plain model (merged out of place)
    vocab_ids = None
    if draft_vocab:
        vocab_ids = truncate_lm_head(model, draft_vocab, list(keep_ids))
    if quantize == "int8":
        model = quantize_int8(model)
    _unshare(model, shared)
    return model.float().eval().requires_grad_(False), vocab_ids


def _unshare(model, shared: dict) -> None:
    """Clone every parameter / buffer of `model` that is still one of the master's tensors."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in shared and shared[id(p)] is p:
                module._parameters[name] = nn.Parameter(p.detach().clone(), requires_grad=False)
        for name, b in list(module._buffers.items()):
            if b is not None and id(b) in shared and shared[id(b)] is b:
                module._buffers[name] = b.clone()
