"""A Qwen2 draft's int8 serving copy run on compiled glue, without transformers' per-layer Python.

The draft runner of the decoding loop (models/runner.py's seam): the same weights as the serving copy of
models/serving_draft.py (int8 linears, one scale per output row; int8 embedding; a derived draft's small LM head),
but each forward is 8 calls per layer into compiled code: rows_linear_int8 (models/kernels.py) for the linears
(q/k/v and gate/up stacked into one matrix each) and the Q4 backend's glue (models/q4_glue.cpp) for RMSNorm, q/k/v
biases + RoPE + KV-cache write, causal GQA attention and SiLU * up. transformers' Qwen2 forward spends about as
long in Python and small torch ops as in the int8 matrices of a 2-layer draft, and the draft's cost per token (c)
decides whether a proposal pays against a 4-bit target: the cheap draft costs 1.7 ms per token here against
2.7 ms through transformers (c 0.054 vs 0.088; the whole 0.5B 14.9 vs 21.4 ms; `osd draft cost --runners
glue,transformers`, BENCHMARKS.md "Derived draft cost").

Row invariance holds as in the serving copy: every glue op and the int8 kernel compute a row the same way
whatever the number of rows fed with it. The floats are not those of the transformers forward (another
attention, exp and RMSNorm order; ~1e-6), which changes at most a proposal at an exact near-tie, never an output:
the target verifies every token.

`glue_draft_runner(model)` gives the runner when the model qualifies (Qwen2, every linear an Int8Linear, all
weight-only int8 or all int8_vnni (activations int8 too: the linears' own kernel path), an int8 embedding, widths
multiples of 8, plain RoPE, no sliding window, the kernels built), else None and the caller keeps the transformers
runner (models/cached.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from osd.errors import ContextTooLong
from osd.models.runner import PositionCache, eos_ids_of

INITIAL_CONTEXT = 1024  # cache positions allocated at first; doubled as a sequence grows


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: tuple  # (weight_int8 (N, K), scale (N,)) of q, k, v stacked
    qkv_bias: torch.Tensor
    o: object  # Int8Linear
    ffn_norm: torch.Tensor
    gate_up: tuple  # gate and up stacked
    down: object  # Int8Linear


def qualifies(model) -> str | None:
    """None when the glue runner can serve `model`, else why not (one line)."""
    from osd.models.serving_draft import Int8Embedding, Int8Linear

    from osd.models.q4_runner import architecture_problem

    config = getattr(model, "config", None)
    why = architecture_problem(config)
    if why:
        return why
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim * heads != config.hidden_size or heads % kv_heads:
        return "head sizes disagree with the hidden size"
    if config.hidden_size % 8 or head_dim % 16 or config.intermediate_size % 8:
        return "widths are not multiples of 8 (head dim: of 16)"
    inner = model.model
    if not isinstance(inner.embed_tokens, Int8Embedding) or not isinstance(model.lm_head, Int8Linear):
        return "not an int8 serving copy"
    vnni = model.lm_head.vnni
    for layer in inner.layers:
        a, f = layer.self_attn, layer.mlp
        linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, f.gate_proj, f.up_proj, f.down_proj)
        if not all(isinstance(x, Int8Linear) for x in linears):
            return "a linear is not an int8 Int8Linear"
        if any(x.vnni != vnni for x in linears):
            return "int8 and int8_vnni linears mixed"
        if a.o_proj.bias is not None or any(x.bias is not None for x in linears[4:]):
            return "biases outside q/k/v"
    return None


def glue_draft_runner(model, context_window: int = 0):
    """The glue runner over `model` (an int8 serving copy), or None where it does not qualify or the glue
    kernels cannot be built (the transformers runner then serves, as before)."""
    if qualifies(model) is not None:
        return None
    try:
        from osd.models.q4_runner import glue

        module = glue()
    except Exception:  # noqa: BLE001 - no compiler / no AVX2: the transformers runner serves
        return None
    return GlueDraftRunner(model, module, context_window)


def _stack(*linears) -> tuple[torch.Tensor, torch.Tensor]:
    """One (weight_int8 (N, K), scale (N,)) over the linears' output rows, for one kernel call. The linears' own
    buffers become row views of it (same values), so the stacked matrix costs no memory beside the serving copy;
    a later runner over the same modules finds them stacked already and reuses the matrix."""
    first = linears[0]
    held = getattr(first, "_glue_stacked", None)
    if held is not None and all(x.weight_int8.untyped_storage().data_ptr() == held[0].untyped_storage().data_ptr()
                                for x in linears):
        return held
    weight = torch.cat([x.weight_int8 for x in linears]).contiguous()
    scale = torch.cat([x.scale for x in linears]).contiguous()
    start = 0
    for x in linears:  # buffers swapped for equal-valued views: a concurrent forward reads either, both right
        stop = start + x.out_features
        x.weight_int8, x.scale = weight[start:stop], scale[start:stop]
        start = stop
    first._glue_stacked = (weight, scale)
    return weight, scale


class GlueDraftRunner(PositionCache):
    """Feeds tokens into a Qwen2 int8 serving copy whose KV cache (float32, (G, T, D) per layer) holds the first
    `length` tokens of one sequence. `model` is the serving copy it reads; its weights are shared, not copied (q/k/v and
    gate/up are stacked into one matrix each, and the copy's linears then read row views of it: `_stack`)."""

    def __init__(self, model, glue_module, context_window: int = 0):
        self.model, self._glue = model, glue_module
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps, self.theta = float(config.rms_norm_eps), float(getattr(config, "rope_theta", 10000.0))
        limit = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.context_window = min(x for x in (context_window, limit) if x) if (context_window or limit) else 0
        inner = model.model
        self._embed, self._norm, self._head = inner.embed_tokens, inner.norm.weight.detach().float().contiguous(), model.lm_head
        self._kernel = model.lm_head.kernel
        self.vnni = bool(model.lm_head.vnni)  # int8_vnni: every linear's activations int8 too
        self.layers = []
        for layer in inner.layers:
            a, f = layer.self_attn, layer.mlp
            biases = [x.bias if x.bias is not None else torch.zeros(x.out_features) for x in (a.q_proj, a.k_proj, a.v_proj)]
            self.layers.append(_Layer(layer.input_layernorm.weight.detach().float().contiguous(),
                                      _stack(a.q_proj, a.k_proj, a.v_proj), torch.cat(biases).float().contiguous(),
                                      a.o_proj, layer.post_attention_layernorm.weight.detach().float().contiguous(),
                                      _stack(f.gate_proj, f.up_proj), f.down_proj))
        self.vocab_size = int(model.lm_head.out_features)
        self.eos_ids = eos_ids_of(getattr(model, "generation_config", None), config)
        self.length, self._capacity = 0, 0
        self._grow(min(INITIAL_CONTEXT, self.context_window or INITIAL_CONTEXT))

    def _reserve(self, n: int) -> None:
        if self.context_window and n > self.context_window:
            super()._reserve(n)  # raises
        self._grow(n)

    def _grow(self, needed: int) -> None:
        """Room for `needed` positions: the cache and RoPE tables reallocated (doubling), cached rows kept."""
        from osd.models.q4_runner import rope_tables

        if needed <= self._capacity:
            return
        capacity = max(needed, 2 * self._capacity)
        if self.context_window:
            capacity = min(capacity, self.context_window)
        shape = (len(self.layers), self.kv_heads, capacity, self.head_dim)
        k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
        if self._capacity:
            k_cache[:, :, : self.length] = self.k_cache[:, :, : self.length]
            v_cache[:, :, : self.length] = self.v_cache[:, :, : self.length]
        self.k_cache, self.v_cache, self._capacity = k_cache, v_cache, capacity
        self._kv = [(k_cache[i], v_cache[i]) for i in range(len(self.layers))]
        self.cos, self.sin = rope_tables(capacity, self.head_dim, self.theta)

    @torch.inference_mode()
    def feed(self, token_ids: list[int], n_logits: int = 1) -> torch.Tensor:
        """Append tokens to the cache; return float32 logits (n_logits, V') for the last positions."""
        x = _forward([self], [token_ids])
        n_logits = max(1, min(n_logits, len(token_ids)))
        return self._logits(x[-n_logits:])  # (n_logits, V')

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head(self._glue.rms_norm(hidden.contiguous(), self._norm, self.eps))


@torch.inference_mode()
def feed_together(runners: list[GlueDraftRunner], token_lists: list[list[int]]) -> torch.Tensor:
    """Several sequences' draft forwards in one: each runner (its own cache, all over the same serving copy) appends
    its tokens -> (len(runners), V') float32 logits of each one's last position. The matrices read every row at once
    (one pass over the draft's weights for all sequences: 4 rows cost ~2.8x one, 8 rows ~4x, on the AMD machine);
    attention stays per sequence on its own cache. Each row's bits are those of its runner's own `feed` (the int8
    kernel and the glue compute a row the same way whatever else is fed with it)."""
    if len({id(r.model) for r in runners}) != 1:
        raise ValueError("feed_together: every runner must serve the same draft model")
    x = _forward(runners, token_lists)
    ends = torch.tensor(list(accumulate(len(t) for t in token_lists))) - 1
    return runners[0]._logits(x[ends])


def _forward(runners: list[GlueDraftRunner], token_lists: list[list[int]]) -> torch.Tensor:
    """The rows of every (runner, tokens) pair through the layers, each appended to its runner's cache
    -> (M, hidden)."""
    ends = []
    for runner, tokens in zip(runners, token_lists):  # every check before any cache changes
        if not tokens:
            raise ValueError("feed: no tokens")
        end = runner.length + len(tokens)
        if runner.context_window and end > runner.context_window:
            raise ContextTooLong(f"{end} tokens exceed the draft's context of {runner.context_window}")
        ends.append(end)
    for runner, end in zip(runners, ends):
        runner._grow(end)
    first = runners[0]
    g, linear, eps, vnni = first._glue, first._kernel, first.eps, first.vnni
    x = first._embed(torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long)).contiguous()
    starts = [0, *accumulate(len(t) for t in token_lists)]
    spans = [(a, b, torch.arange(r.length, end)) for r, a, b, end in zip(runners, starts, starts[1:], ends)]
    for i, layer in enumerate(first.layers):
        qkv = linear(g.rms_norm(x, layer.attn_norm, eps), *layer.qkv, None, vnni)  # (M, (H + 2G) D)
        attended = []
        for runner, (a, b, pos) in zip(runners, spans):
            k_cache, v_cache = runner._kv[i]
            q = g.qkv_rope(qkv[a:b], layer.qkv_bias, runner.cos, runner.sin, pos, k_cache, v_cache, first.heads)
            attended.append(g.attention(q, k_cache, v_cache, pos))
        x = x + layer.o(attended[0] if len(attended) == 1 else torch.cat(attended))
        gate_up = linear(g.rms_norm(x, layer.ffn_norm, eps), *layer.gate_up, None, vnni)  # (M, 2 I)
        x = x + layer.down(g.silu_mul(gate_up))
    for runner, end in zip(runners, ends):
        runner.length = end
    return x
