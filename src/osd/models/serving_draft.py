"""Cheap serving copies of a draft model (speed tricks, each optional and explained).

- int8: dynamic int8 quantisation of every nn.Linear (weights int8, activations quantised on the
  fly). Decoding a 0.5B draft is memory-bandwidth bound on CPU: int8 weights move 4x fewer bytes
  than fp32, so a draft step costs a fraction of the fp32 one. The draft's precision only changes
  acceptance, never the output (the target verifies every token).
- draft_vocab=N: the LM head keeps only token ids < N plus the special tokens. Qwen2.5's BPE ids
  are roughly in merge (frequency) order, so low ids cover nearly all text; the LM head over the
  full 151,936-token vocabulary is ~27% of a 0.5B draft's per-token work.
The master weights stay untouched (the learner trains them); these copies are rebuilt on publish.
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn


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


def quantize_int8(model):
    """Dynamic int8 quantisation of all nn.Linear layers (in place; CPU only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)


def make_serving_draft(master, quantize: str = "none", draft_vocab: int = 0, keep_ids: list[int] = ()):
    """Return (serving_model, vocab_ids or None): a frozen, possibly quantised/truncated copy."""
    from osd.learn.trainable import merge_lora

    model = copy.deepcopy(master).float().eval().requires_grad_(False)
    merge_lora(model)  # a LoRA-trained master serves as a plain model
    vocab_ids = None
    if draft_vocab:
        vocab_ids = truncate_lm_head(model, draft_vocab, list(keep_ids))
    if quantize == "int8":
        model = quantize_int8(model)
    return model, vocab_ids
