"""A draft's 4-bit serving copy on the Q4 kernel: the target's own fast path, for a deep draft.

Decoding one token reads every weight once, so a draft's cost per token (c, in target tokens) is about its bytes
over the target's. The int8 serving copy (models/serving_draft.py) keeps the whole bundled 0.5B at ~0.5 GB a token,
more than the 1.5B target's Q4 GGUF moves (c 1.22 measured: BENCHMARKS.md, the multilingual depth run), so that
draft could never pay though it knows the languages the cheap draft does not (teacher-forced alpha 0.71-0.75 against
0.04-0.11). Quantized to Q4_K (its LM head Q6_K, as a Q4_K_M GGUF holds it) it moves ~0.35 GB a token, on the
same kernel as the target (models/q4.py), and runs on the target's runner (models/q4_runner.py `Q4Runner`).

`q4_serving_copy(model, ...)` builds it from a Hugging Face causal LM of any family the target's runner runs
(models/architectures.py): Qwen2, Llama (Mistral without a sliding window is one), Qwen3, Gemma 3 (text) -- the
master the learner trains, a derived draft with its restricted LM head too (models/derived.py: the head's N rows are
quantized as they are; the vocabulary map travels beside the copy, as for the int8 copy). Each matrix is quantized by
models/q4_quantize.py (input widths padded with zero columns to whole 256-blocks: the 0.5B's 896), the embedding as
Q8_0 rows (looked up one row per token), norms and biases float32. The weights go in as the runner holds a GGUF's
after loading, which is transformers' own convention: a Llama's q/k rows in transformers' rotate-half order (the
runner un-permutes a GGUF's; nothing to undo here), Llama 3's `rope_scaling` as the converter's `rope_freqs` factors,
linear scaling as `rope_scale`, Gemma's RMSNorm weights as 1 + w (Gemma3RMSNorm multiplies by 1 + w; the GGUF stores
that), Gemma's query_pre_attn_scalar as the attention scale and each layer's sliding / full kind from the config's
`layer_types` (a derived draft keeps its kept layers' kinds). A publish builds a new copy from the updated master
(seconds for the 0.5B on 2 cores), so online learning works as with the int8 copy. Rows are bitwise independent of
how many are fed together (the kernel's property), as every draft runner's are.

Limitations: the families above only, as the runner runs them (no YaRN/dynamic/LongRoPE scaling, logit softcapping,
Qwen sliding windows, biases outside q/k/v, a Gemma local RoPE base other than 10000); `qualifies` names what it
refuses, and `--draft-quantize auto` then serves int8. The Q4 kernel must build here (AVX2); 4-bit weights can cost
acceptance, never an output (the 0.5B's copy drafted at live alpha 0.80 on 24 prompts, BENCHMARKS.md); a 24-layer
draft's prompt prefill is what it feeds beyond the prefix a draft already cached (propose/draft_model.py), and for
whole requests it spends much of its decode lead (`scripts/bench_scheduler.py`, BENCHMARKS.md).
"""
from __future__ import annotations

import math
import threading
import weakref

import torch

from osd.errors import BackendUnavailable, InvalidArgument
from osd.models import q4
from osd.models.architectures import Architecture, architecture
from osd.models.eos import eos_ids_of
from osd.models.q4_quantize import pad_columns, quantize_q4k, quantize_q6k, quantize_q8_0
from osd.models.q4_runner import ModelShape, Q4Runner, Q4Weights

EMBEDDING_TYPE = "Q8_0"  # the token table: one row dequantized per token fed (gguf's reference), 8.5 bits a weight
MAX_CONTEXT = 32768  # positions a runner's cache may hold (reserved, touched only as it fills)
# Hugging Face model_type -> the runner's family (models/architectures.py). Mistral is a Llama with a sliding window:
# without one, llama.cpp's converter writes it as a llama GGUF, and so does this.
FAMILIES = {"qwen2": "qwen2", "llama": "llama", "mistral": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3"}
ACTIVATIONS = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_new")}  # runner's -> HF names
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


def qualifies(model) -> str | None:
    """None when `model` can be served on the Q4 kernel, else why not (one line)."""
    config = getattr(model, "config", None)
    why = config_problem(config)
    if why:
        return why
    s = shape_of(config)
    if s.head_dim % 16 or s.heads % s.kv_heads:
        return f"head dim {s.head_dim} (the glue needs a multiple of 16) or {s.heads} heads over {s.kv_heads} KV heads"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) != s.layers:
        return "no decoder stack model.model.layers of config.num_hidden_layers layers"
    for layer in layers:
        a, f = layer.self_attn, layer.mlp
        if any(getattr(m, "bias", None) is not None for m in (a.o_proj, f.gate_proj, f.up_proj, f.down_proj)):
            return "biases outside q/k/v (the runner adds q/k/v biases only)"
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        return "the LM head has a bias"
    return None


def family_of(config) -> Architecture:
    """The runner's family of a Hugging Face config (InvalidArgument naming the model type where there is none)."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise InvalidArgument(f"a {kind!r} model (the Q4 copy runs {', '.join(sorted(set(FAMILIES)))})")
    return architecture(FAMILIES[kind])


def config_problem(config) -> str | None:
    """None when the config describes what the runner's forward of its family computes, else why not (one line)."""
    if config is None:
        return "no config"
    try:
        family = family_of(config)
    except InvalidArgument as e:
        return str(e)
    act = getattr(config, "hidden_activation", None) if family.name == "gemma3" else None
    act = act or getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS[family.activation]:
        return f"activation {act!r} (the runner's {family.name} forward computes {family.activation})"
    try:
        rope_parameters(config, family)
    except InvalidArgument as e:
        return str(e)
    if (getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return "partial RoPE"
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, key, None):
            return f"{key} (the runner has no logit softcapping)"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if not family.swa_pattern:
        if getattr(config, "use_sliding_window", False) or SLIDING in (getattr(config, "layer_types", None) or ()):
            return "sliding-window attention"
        if family.name == "llama" and getattr(config, "sliding_window", None):
            return f"a sliding window of {config.sliding_window} ({config.model_type})"
    else:
        kinds = list(getattr(config, "layer_types", None) or ())
        if len(kinds) != config.num_hidden_layers or set(kinds) - {SLIDING, FULL}:
            return f"layer types {sorted(set(kinds))} over {config.num_hidden_layers} layers"
        if SLIDING in kinds and not (getattr(config, "sliding_window", None) or 0) > 0:
            return "sliding layers without a sliding window"
        local = float(getattr(config, "rope_local_base_freq", family.swa_rope_base))
        if local != family.swa_rope_base:
            return f"sliding layers' RoPE base {local:g} (the runner's is {family.swa_rope_base:g})"
    return None


def rope_parameters(config, family: Architecture) -> tuple[float, torch.Tensor | None]:
    """(linear scale, rope_freqs factors or None) of the config's `rope_scaling`, as llama.cpp's converter writes a
    GGUF's: linear -> rope.scaling.factor; Llama 3 -> the `rope_freqs` tensor (LlamaModel.generate_extra_tensors:
    each frequency divided by its factor). InvalidArgument naming any other scaling."""
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return 1.0, None
    if kind == "linear" and "linear" in family.rope_scalings:
        return float(scaling["factor"]), None
    if kind == "llama3" and family.rope_freqs:
        return 1.0, llama3_factors(config, scaling)
    raise InvalidArgument(f"{kind!r} RoPE scaling for {family.name}")


def llama3_factors(config, scaling: dict) -> torch.Tensor:
    """(head_dim / 2,) float32: the converter's Llama 3 `rope_freqs` (what divides each RoPE frequency)."""
    dim = _head_dim(config)
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * float(config.rope_theta) ** (i / dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def shape_of(config) -> ModelShape:
    """The runner's shape of a Hugging Face config (`config_problem` None)."""
    family = family_of(config)
    heads, head_dim = config.num_attention_heads, _head_dim(config)
    scale, _ = rope_parameters(config, family)
    window, kinds, attention_scale = 0, (), 0.0
    if family.swa_pattern:
        kinds = tuple(kind == SLIDING for kind in config.layer_types)
        window = int(config.sliding_window or 0) if any(kinds) else 0
        scalar = float(getattr(config, "query_pre_attn_scalar", None) or head_dim)
        attention_scale = 0.0 if scalar == head_dim else scalar**-0.5
    return ModelShape(layers=config.num_hidden_layers, hidden=config.hidden_size,
                      intermediate=config.intermediate_size, heads=heads,
                      kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                      rope_theta=float(getattr(config, "rope_theta", 10000.0)), eps=float(config.rms_norm_eps),
                      context_length=min(int(getattr(config, "max_position_embeddings", 0) or MAX_CONTEXT), MAX_CONTEXT),
                      arch=family.name, rope_scale=scale, sliding_window=window, attention_scale=attention_scale,
                      sliding_layers=kinds)


_UNCHANGED: dict = {}  # (kind, ids of the source tensors) -> (weak references to them, their versions then, result)
_UNCHANGED_LOCK = threading.Lock()


def _reused(kind: str, tensors: list[torch.Tensor], build):
    """build() of `tensors`, reused while they are the same tensor objects, unchanged in place (their version
    counters): a learner publishes every update, and what it does not train (the embedding, the frozen layers, a
    restricted head) would be quantized again each time (the token table alone: 0.45 s of a 0.76 s publish of the
    cheap draft on the Zen 4 machine). Results are shared, read-only. Tensors are held by weak reference: a freed
    tensor's memory taken by another never passes for it, and entries of freed tensors are dropped."""
    key = (kind, tuple(id(t) for t in tensors))
    with _UNCHANGED_LOCK:  # (per-draft learners publish from their own threads)
        hit = _UNCHANGED.get(key)
    if hit is not None and all(r() is t and v == t._version for r, v, t in zip(hit[0], hit[1], tensors)):
        return hit[2]
    result = build()
    with _UNCHANGED_LOCK:
        for stale in [k for k, (refs, _, _) in _UNCHANGED.items() if any(r() is None for r in refs)]:
            del _UNCHANGED[stale]
        _UNCHANGED[key] = ([weakref.ref(t) for t in tensors], [t._version for t in tensors], result)
    return result


def _matrix(weights: list[torch.Tensor], kind: str = "Q4_K") -> list:
    """Matrices reading one input, stacked by output rows -> [the kernel's weight] (input width padded)."""
    def build():
        stacked = pad_columns(torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0])
        return q4.repack(quantize_q4k(stacked) if kind == "Q4_K" else quantize_q6k(stacked), kind)
    return [_reused(kind, weights, build)]


def _embedding_rows(table: torch.Tensor):
    """The token table as gguf's Q8_0 rows (quantized once while unchanged: `_reused`)."""
    return _reused("Q8_0", [table], lambda: quantize_q8_0(table).numpy())


def _float(t: torch.Tensor | None, size: int, shift: float = 0.0) -> torch.Tensor:
    return t.detach().float() + shift if t is not None else torch.zeros(size)  # a new tensor either way


def q4_weights(model) -> Q4Weights:
    """A Hugging Face causal LM (`qualifies`) -> Q4Weights for Q4Runner, named and shaped as the runner holds a GGUF's
    (see the module docstring)."""
    s = shape_of(model.config)
    family = architecture(s.arch)
    shift = 1.0 if family.name == "gemma3" else 0.0  # Gemma3RMSNorm: x (1 + w), the GGUF's 1 + w
    norm = lambda module, size=s.hidden: _float(module.weight, size, shift)  # noqa: E731
    vectors, matrices = {"output_norm": norm(model.model.norm)}, {}
    for i, layer in enumerate(model.model.layers):
        a, f = layer.self_attn, layer.mlp
        vectors[f"blk.{i}.attn_norm"] = norm(layer.input_layernorm)
        if family.post_norms:  # Gemma: post_attention_layernorm normalizes the attention output, before its residual
            vectors[f"blk.{i}.attn_post_norm"] = norm(layer.post_attention_layernorm)
            vectors[f"blk.{i}.ffn_norm"] = norm(layer.pre_feedforward_layernorm)
            vectors[f"blk.{i}.ffn_post_norm"] = norm(layer.post_feedforward_layernorm)
        else:
            vectors[f"blk.{i}.ffn_norm"] = norm(layer.post_attention_layernorm)
        if family.qk_norm:
            vectors[f"blk.{i}.q_norm"] = norm(a.q_norm, s.head_dim)
            vectors[f"blk.{i}.k_norm"] = norm(a.k_norm, s.head_dim)
        vectors[f"blk.{i}.qkv_bias"] = torch.cat([_float(p.bias, p.out_features) for p in (a.q_proj, a.k_proj, a.v_proj)])
        matrices[f"blk.{i}.qkv"] = _matrix([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        matrices[f"blk.{i}.attn_output"] = _matrix([a.o_proj.weight])
        matrices[f"blk.{i}.gate_up"] = _matrix([f.gate_proj.weight, f.up_proj.weight])
        matrices[f"blk.{i}.ffn_down"] = _matrix([f.down_proj.weight])
    _, factors = rope_parameters(model.config, family)
    if factors is not None:
        vectors["rope_freqs"] = factors
    # a derived draft's head: its N rows (the map rides beside); no bias (`qualifies`)
    matrices["output"] = _matrix([model.get_output_embeddings().weight], "Q6_K")
    # gguf's Q8_0 rows, bit for bit; Gemma's unscaled (the runner multiplies looked-up rows by sqrt(hidden))
    embd = _embedding_rows(model.get_input_embeddings().weight)
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
    """The Q4 serving copy of a draft (merged, eval) of a family the runner runs: BackendUnavailable where the kernel
    cannot build here, InvalidArgument (with `qualifies`' reason) for a model it cannot run."""
    why = qualifies(model)
    if why:
        raise InvalidArgument("the Q4 draft serving copy (--draft-quantize q4) runs qwen2, llama, qwen3 and gemma3 "
                              f"drafts the target's Q4 runner runs; not this one: {why}")
    if not q4.available():
        raise BackendUnavailable("--draft-quantize q4 needs osd's Q4 kernel, which cannot be built here: "
                                 f"{(q4.build_error() or 'unknown').splitlines()[0][:160]} (use --draft-quantize int8)")
    with torch.no_grad():
        return Q4Draft(q4_weights(model))
