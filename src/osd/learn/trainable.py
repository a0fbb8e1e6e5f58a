"""Which draft parameters train, and the frozen-trunk split that makes CPU training cheap.

trainable: "all" | "no_embeddings" (freeze embeddings and LM head, which Qwen2.5 ties) | "lora" | "adapter"
(the parameters the caller already marked trainable, e.g. the active peft adapter of drafts_multi.py).
train_layers: 0 = every decoder layer trains; N = only the top N layers (and the final norm) train
(all of them when the draft has N or fewer).
With N > 0 the bottom layers are frozen, so their output for a token sequence never changes:
`trunk_features` computes it once (no grad) and items keep it, and every later forward / backward
runs only the top N layers (`head_logits_at`). On the 24-layer 0.5B draft, N = 2 trains at ~1/12
of the full cost.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

from osd.errors import InvalidArgument

TRAINABLE = ("all", "no_embeddings", "lora", "adapter")


class LoRALinear(nn.Module):
    """y = W x + (alpha / r) * B A x, with W frozen; B starts at zero so the wrapped layer is unchanged."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0):
        super().__init__()
        self.base, self.scale = base, alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale

    def merged(self) -> nn.Linear:
        """A plain linear with the adapter folded in; a new weight tensor (the base's is left as it is)."""
        linear = copy.copy(self.base)
        linear._parameters = dict(self.base._parameters)
        with torch.no_grad():
            linear.weight = nn.Parameter(self.base.weight + (self.lora_b @ self.lora_a) * self.scale, requires_grad=False)
        return linear


def decoder_layers(model) -> nn.ModuleList:
    return model.model.layers


def split_index(model, train_layers: int) -> int:
    """Index of the first trainable decoder layer (0 = all train; N >= the draft's depth also means all)."""
    if train_layers < 0:
        raise InvalidArgument(f"train_layers must be >= 0, got {train_layers}")
    return max(0, len(decoder_layers(model)) - train_layers) if train_layers else 0


def configure_trainable(model, trainable: str = "no_embeddings", train_layers: int = 0, lora_rank: int = 8) -> list:
    """Set requires_grad (and insert LoRA adapters); returns the parameters to optimise."""
    if trainable not in TRAINABLE:
        raise InvalidArgument(f"trainable must be one of {TRAINABLE}, got {trainable!r}")
    split = split_index(model, train_layers)
    if trainable == "adapter":  # set up by the caller (a peft adapter made active): nothing inserted or frozen here
        return [p for p in model.parameters() if p.requires_grad]
    if trainable == "all" and split > 0:
        raise InvalidArgument("trainable=all trains the embeddings, which sit below every layer: use train_layers=0")
    model.requires_grad_(False)
    top = decoder_layers(model)[split:]
    if trainable == "lora":
        for layer in top:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(parent, name, LoRALinear(child, lora_rank))
        return [p for n, p in model.named_parameters() if "lora_" in n]
    if trainable == "all":
        model.requires_grad_(True)
    else:
        top.requires_grad_(True)
        model.model.norm.requires_grad_(True)
    return [p for p in model.parameters() if p.requires_grad]


def merge_lora(model) -> None:
    """Fold LoRA adapters into their base linears (the model becomes a plain HF model again)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, name, child.merged())


def _run_layers(model, hidden: torch.Tensor, layers) -> torch.Tensor:
    """Right-padded (B, T, H) through `layers` with a causal mask (padding sits after real tokens)."""
    from transformers.masking_utils import create_causal_mask

    positions = torch.arange(hidden.shape[1]).unsqueeze(0)
    cache_position = positions[0]
    mask = create_causal_mask(config=model.config, input_embeds=hidden, attention_mask=None,
                              cache_position=cache_position, past_key_values=None, position_ids=positions)
    rope = model.model.rotary_emb(hidden, positions)
    for layer in layers:
        hidden = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    return hidden


@torch.no_grad()
def trunk_features(model, input_ids: torch.Tensor, split: int) -> torch.Tensor:
    """(B, T) ids -> (B, T, H) hidden states entering layer `split` (frozen part, no grad)."""
    hidden = model.model.embed_tokens(input_ids)
    return _run_layers(model, hidden, decoder_layers(model)[:split])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rows_only_supported(model, layer) -> bool:
    """A plain pre-norm RoPE decoder layer (Llama / Qwen2 / Mistral shape, full attention, no dropout, no
    q/k norms): the only shape `last_layer_at_rows` reproduces; anything else runs the layer whole."""
    attn = getattr(layer, "self_attn", None)
    return (all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim"))
            and all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp"))
            and not any(hasattr(attn, n) for n in ("q_norm", "k_norm"))
            and getattr(attn, "sliding_window", None) is None
            and not getattr(model.config, "attention_dropout", 0.0))


def last_layer_at_rows(layer, hidden: torch.Tensor, rope, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The decoder layer's output at (rows, cols) only -> (N, H), from its (B, T, H) input.

    Keys and values need every position, but queries, attention, o_proj and the MLP only the supervised
    ones: in the last layer that is most of its cost (32 supervised positions of a 300-token context).
    Same values as running the layer whole and indexing, up to float rounding
    (tests/distill/test_trainable_and_buffer.py).
    """
    attn, (batch, width, _) = layer.self_attn, hidden.shape
    d = attn.head_dim
    cos, sin = rope  # (1, T, d)
    x = layer.input_layernorm(hidden)
    keys = _rotate(attn.k_proj(x).view(batch, width, -1, d).transpose(1, 2), cos[:, None], sin[:, None])  # (B, KV, T, d)
    values = attn.v_proj(x).view(batch, width, -1, d).transpose(1, 2)
    queries = attn.q_proj(x[rows, cols]).view(len(rows), -1, d)  # (N, Hq, d)
    queries = _rotate(queries, cos[0, cols][:, None], sin[0, cols][:, None])
    group = queries.shape[1] // keys.shape[1]
    out = torch.empty_like(queries)
    for b in rows.unique().tolist():
        sel = (rows == b).nonzero().squeeze(1)
        visible = torch.arange(width)[None, :] <= cols[sel][:, None]  # (n, T): causal, padding is never visible
        out[sel] = torch.nn.functional.scaled_dot_product_attention(
            queries[sel].transpose(0, 1), keys[b].repeat_interleave(group, 0), values[b].repeat_interleave(group, 0),
            attn_mask=visible, scale=attn.scaling).transpose(0, 1).to(out.dtype)  # (bf16 under autocast)
    h = hidden[rows, cols] + attn.o_proj(out.reshape(len(rows), -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def head_logits_at(model, features: torch.Tensor, split: int, rows: torch.Tensor, cols: torch.Tensor,
                   rows_only: bool = True) -> torch.Tensor:
    """Top layers + final norm over (B, T, H) trunk features; LM head only at (rows, cols) -> (N, V).

    rows_only: the last layer runs at (rows, cols) only when its shape allows (`rows_only_supported`)."""
    layers = decoder_layers(model)[split:]
    if not (rows_only and len(layers) and rows_only_supported(model, layers[-1])):
        hidden = _run_layers(model, features, layers)
        return model.lm_head(model.model.norm(hidden[rows, cols])).float()
    hidden = _run_layers(model, features, layers[:-1]) if len(layers) > 1 else features  # (no mask to build: ~9 ms)
    rope = model.model.rotary_emb(hidden, torch.arange(hidden.shape[1]).unsqueeze(0))
    return model.lm_head(model.model.norm(last_layer_at_rows(layers[-1], hidden, rope, rows, cols))).float()
