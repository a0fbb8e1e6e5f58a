"""Cheap serving copies of a draft model (speed tricks, each optional and explained).

- int8: int8 weights for every nn.Linear. Decoding a 0.5B draft is memory-bandwidth bound on CPU: int8
  weights move 4x fewer bytes than fp32, so a draft step costs a fraction of the fp32 one. With our
  rows_linear_int8 kernel (models/kernels.py) the weights are int8 with one scale per output row and the
  activations stay fp32 (weight-only), and attention and SiLU are the row-invariant ones
  (models/invariant.py): a draft position's logits do not depend on how many rows were fed with it.
  Without the kernels: KernelUnavailable, or where a fallback is allowed torch's dynamic int8
  quantisation (activations quantised on the fly too; ~9 points less acceptance), recorded in
  kernels.status(). The draft's precision only changes acceptance, never the output (the target
  verifies every token).
- int8_vnni: int8 activations too (per row, blocks of 32), multiplied by AVX-512 VNNI: 1.1-1.8x faster
  linears than int8 (1 thread, 1-9 rows, 896x4864 / 4864x896), still row-invariant; next-token agreement
  with the fp32 draft 97.4% vs 98.1% for int8 (bundled 0.5B, 700 teacher-forced positions). Opt-in: end to
  end, on the glue runner, it decoded level with int8 (Intel, 2.20x vs 2.24x llama.cpp, `osd bench speed --arms
  osd_q4,osd_q4_vnni`, BENCHMARKS.md); refused on CPUs without VNNI.
- q4: 4-bit (Q4_K matrices, a Q6_K LM head) on the target's own Q4 kernel, for a deep draft whose int8 copy moves more
  bytes a token than the Q4 target: models/q4_draft.py (the whole bundled 0.5B: c 0.39 against 1.16 for int8).
- auto (the default): for a draft the Q4 kernel runs (`resolve_quantize`: a qwen2, llama, qwen3 or gemma3 text model
  q4_draft.py qualifies, the kernel built here), q4 or
  int8, whichever times faster on this machine (propose/copy_choice.py); int8 for any other. Measured on the shipped
  cheap draft (Intel, `osd bench speed`, BENCHMARKS.md): its Q4 copy cost c 0.023 target tokens a token against
  0.051 for int8, for 0.004 less acceptance.
- draft_vocab=N: the LM head keeps only token ids < N plus the special tokens (a derived draft, models/derived.py,
  brings its own vocabulary map instead). Qwen2.5's BPE ids
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

from osd.errors import InvalidArgument, KernelUnavailable
from osd.models import kernels
from osd.models.invariant import make_row_invariant


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
    """int8 weights, one symmetric scale per output row; every row count through the kernel. vnni: the
    activations are quantised too, per row in blocks of 32, and multiplied by AVX-512 VNNI (rows_linear.cpp)."""

    def __init__(self, linear: nn.Linear, kernel, vnni: bool = False):
        super().__init__()
        weight = linear.weight.detach().float()  # (N, K)
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # (N,)
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.kernel, self.vnni, self.in_features, self.out_features = kernel, vnni, linear.in_features, linear.out_features
        self.source_weight_id = id(linear.weight)  # which float matrix it came from (to detect a tied embedding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (M, K)
        out = self.kernel(flat, self.weight_int8, self.scale, self.bias, self.vnni)  # (M, N)
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


def int8_linears(model: nn.Module, kernel, vnni: bool = False) -> nn.Module:
    """Every nn.Linear of `model` -> Int8Linear on `kernel` (in place, one at a time, by name: a float weight nothing
    else holds is freed as soon as its int8 copy exists). The draft's int8 copy and the feature head's share it."""
    names = [name for name, child in model.named_modules(remove_duplicate=False) if type(child) is nn.Linear]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Int8Linear(getattr(parent, attr), kernel, vnni))
    return model


def quantize_int8(model, allow_fallback: bool = False, vnni: bool = False,
                  use: str = "draft int8 linears: torch dynamic int8"):
    """int8 weights for all nn.Linear layers (in place): weight-only with our kernel (plus row-invariant
    attention and SiLU); `vnni` (where kernels.vnni_available()): int8 activations too, on AVX-512 VNNI.
    Without the kernels: KernelUnavailable, or with `allow_fallback` torch's dynamic int8 (recorded as `use`).
    Linears are replaced one at a time, by name: a float weight nothing else holds is freed as soon as its
    int8 copy exists (a target quantized at load never holds a second whole copy)."""
    module = kernels.load(allow_fallback, use=use)
    if module is not None and vnni and not module.has_vnni():
        raise KernelUnavailable("int8_vnni needs a CPU with AVX-512 VNNI; this one has none: use int8")
    if module is not None:
        int8_linears(model, module.rows_linear_int8, vnni)
        _quantize_embedding(model)
        model.config.tie_word_embeddings = False
        make_row_invariant(model, module)
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)


def resolve_quantize(quantize: str, master) -> str:
    """The serving copy `quantize` names for this draft without timing anything: "auto" -> "q4" where the draft
    qualifies for the Q4 copy (models/q4_draft.py: a family the Q4 runner runs, a head dim the glue takes) and the
    Q4 kernel builds
    here, else "int8"; any other value as given. (build_system resolves auto by timing both: propose/copy_choice.py.)"""
    if quantize != "auto":
        return quantize
    from osd.models import q4
    from osd.models.q4_draft import qualifies

    return "q4" if qualifies(master) is None and q4.available() else "int8"


def make_serving_draft(master, quantize: str = "none", draft_vocab: int = 0, keep_ids: list[int] = (),
                       allow_kernel_fallback: bool = False):
    """Return (serving_model, vocab_ids or None): a frozen, possibly quantised/truncated copy.

    The copy starts by sharing every master tensor (no transient fp32 copy of the draft); quantisation and
    truncation replace the big ones with new tensors, and whatever is still shared at the end is cloned, so
    later updates of the master never reach a published copy.
    """
    from osd.learn.trainable import merge_lora
    from osd.models.vocab_map import vocab_ids_of

    quantize = resolve_quantize(quantize, master)
    shared = {id(t): t for t in itertools.chain(master.parameters(), master.buffers())}
    model = copy.deepcopy(master, dict(shared))
    merge_lora(model)  # a LoRA-trained master serves as a plain model (merged out of place)
    vocab_ids = vocab_ids_of(model)  # a derived draft's own vocabulary map (models/derived.py), else None
    if draft_vocab:
        if vocab_ids is not None:
            raise InvalidArgument("this draft's LM head already covers a vocabulary map (a derived draft): "
                                  "leave draft_vocab at 0")
        vocab_ids = truncate_lm_head(model, draft_vocab, list(keep_ids))
    if quantize == "q4":  # new tensors from every master tensor (read as float32): nothing of the master is kept
        from osd.models.q4_draft import q4_serving_copy

        return q4_serving_copy(model), vocab_ids
    if quantize in ("int8", "int8_vnni"):
        model = quantize_int8(model, allow_kernel_fallback, vnni=quantize == "int8_vnni")
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
