"""A draft's 4-bit serving copy on the Q4 kernel: the target's own fast path, for a deep draft.

Decoding one token reads every weight once, so a draft's cost per token (c, in target tokens) is about its bytes
over the target's. The int8 serving copy (models/serving_draft.py) keeps the whole bundled 0.5B at ~0.5 GB a token,
more than the 1.5B target's Q4 GGUF moves (c 1.22 measured: BENCHMARKS.md, the multilingual depth run), so that
draft could never pay though it knows the languages the cheap draft does not (teacher-forced alpha 0.71-0.75 against
0.04-0.11). Quantized to Q4_K (its LM head Q6_K, as a Q4_K_M GGUF holds it) it moves ~0.35 GB a token, on the
same kernel as the target (models/q4.py), and runs on the target's runner (models/q4_runner.py `Q4Runner`).

`q4_serving_copy(model, ...)` builds it from a Hugging Face Qwen2 (the master the learner trains; a derived draft
with its restricted LM head too): each matrix quantized by models/q4_quantize.py (input widths padded with zero
columns to whole 256-blocks: the 0.5B's 896), the embedding as Q8_0 rows (looked up one row per token), norms and
biases float32. A publish builds a new copy from the updated master (seconds for the 0.5B on 2 cores), so online
learning works as with the int8 copy. Rows are bitwise independent of how many are fed together (the kernel's
property), as every draft runner's are.

Limitations: Qwen2 only (the runner's architecture); the Q4 kernel must build here (AVX2); 4-bit weights can cost
acceptance, never an output (the 0.5B's copy drafted at live alpha 0.80 on 24 prompts, BENCHMARKS.md); a 24-layer
draft's prompt prefill is what it feeds beyond the prefix a draft already cached (propose/draft_model.py), and for
whole requests it spends much of its decode lead (`scripts/bench_scheduler.py`, BENCHMARKS.md).
"""
from __future__ import annotations

import torch

from osd.errors import BackendUnavailable, InvalidArgument
from osd.models import q4
from osd.models.eos import eos_ids_of
from osd.models.q4_quantize import pad_columns, quantize_q4k, quantize_q6k, quantize_q8_0
from osd.models.q4_runner import Q4Runner, Q4Weights, Qwen2Shape, architecture_problem

EMBEDDING_TYPE = "Q8_0"  # the token table: one row dequantized per token fed (gguf's reference), 8.5 bits a weight
MAX_CONTEXT = 32768  # positions a runner's cache may hold (reserved, touched only as it fills)


def qualifies(model) -> str | None:
    """None when `model` can be served on the Q4 kernel, else why not (one line)."""
    config = getattr(model, "config", None)
    why = architecture_problem(config)
    if why:
        return why
    s = shape_of(config)
    if s.head_dim % 16 or s.heads % s.kv_heads:
        return f"head dim {s.head_dim} (the glue needs a multiple of 16) or {s.heads} heads over {s.kv_heads} KV heads"
    return None


def shape_of(config) -> Qwen2Shape:
    heads = config.num_attention_heads
    return Qwen2Shape(layers=config.num_hidden_layers, hidden=config.hidden_size,
                      intermediate=config.intermediate_size, heads=heads,
                      kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                      head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                      rope_theta=float(getattr(config, "rope_theta", 10000.0)), eps=float(config.rms_norm_eps),
                      context_length=min(int(getattr(config, "max_position_embeddings", 0) or MAX_CONTEXT), MAX_CONTEXT))


def _matrix(weights: list[torch.Tensor], kind: str = "Q4_K") -> list:
    """Matrices reading one input, stacked by output rows -> [the kernel's weight] (input width padded)."""
    stacked = pad_columns(torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0])
    raw = quantize_q4k(stacked) if kind == "Q4_K" else quantize_q6k(stacked)
    return [q4.repack(raw, kind)]


def _float(t: torch.Tensor | None, size: int) -> torch.Tensor:
    return t.detach().float().clone() if t is not None else torch.zeros(size)


def q4_weights(model) -> Q4Weights:
    """A Hugging Face Qwen2 causal LM -> Q4Weights for Q4Runner (see the module docstring)."""
    s = shape_of(model.config)
    vectors, matrices = {"output_norm": _float(model.model.norm.weight, s.hidden)}, {}
    for i, layer in enumerate(model.model.layers):
        a, f = layer.self_attn, layer.mlp
        vectors[f"blk.{i}.attn_norm"] = _float(layer.input_layernorm.weight, s.hidden)
        vectors[f"blk.{i}.ffn_norm"] = _float(layer.post_attention_layernorm.weight, s.hidden)
        vectors[f"blk.{i}.qkv_bias"] = torch.cat([_float(p.bias, p.out_features) for p in (a.q_proj, a.k_proj, a.v_proj)])
        matrices[f"blk.{i}.qkv"] = _matrix([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        matrices[f"blk.{i}.attn_output"] = _matrix([a.o_proj.weight])
        matrices[f"blk.{i}.gate_up"] = _matrix([f.gate_proj.weight, f.up_proj.weight])
        matrices[f"blk.{i}.ffn_down"] = _matrix([f.down_proj.weight])
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise InvalidArgument("the draft's LM head has a bias: the Q4 serving copy has none")
    matrices["output"] = _matrix([head.weight], "Q6_K")
    embd = quantize_q8_0(model.get_input_embeddings().weight).numpy()  # gguf's Q8_0 rows, bit for bit
    eos = eos_ids_of(getattr(model, "generation_config", None), model.config)
    return Q4Weights(s, sorted(eos), vectors, EMBEDDING_TYPE, embd, matrices)


class Q4Draft(torch.nn.Module):
    """A published draft's Q4 serving copy: its weights for the kernel, and a runner per sequence over them.

    A Module so that the registry and the proposer treat it as any serving copy; its only buffers are views of the
    last layer's down projection (the weights that every way of training changes), which `weights_fingerprint`
    (drafts.py) reads as it reads an int8 copy's."""

    def __init__(self, weights: Q4Weights):
        super().__init__()
        self.weights = weights
        down = weights.matrices[f"blk.{weights.shape.layers - 1}.ffn_down"][0]
        for name in ("qs", "sm", "dd"):
            self.register_buffer(name, getattr(down, name))

    @property
    def vocab_size(self) -> int:
        return sum(w.n for w in self.weights.matrices["output"])

    def runner(self) -> Q4Runner:
        """A runner (its own KV cache) over this copy; `runner.model` names the copy, as a glue runner's does."""
        runner = Q4Runner.from_weights(self.weights, self.weights.shape.context_length)
        runner.model = self
        return runner


def q4_serving_copy(model) -> Q4Draft:
    """The Q4 serving copy of a Qwen2 draft (merged, eval): BackendUnavailable where the kernel cannot build here,
    InvalidArgument for a model it cannot run."""
    why = qualifies(model)
    if why:
        raise InvalidArgument(f"the Q4 draft serving copy (--draft-quantize q4) runs Qwen2 drafts only: {why}")
    if not q4.available():
        raise BackendUnavailable("--draft-quantize q4 needs osd's Q4 kernel, which cannot be built here: "
                                 f"{(q4.build_error() or 'unknown').splitlines()[0][:160]} (use --draft-quantize int8)")
    with torch.no_grad():
        return Q4Draft(q4_weights(model))
