"""A draft that reads the target's features (EAGLE family): the head, its int8 serving copy, its file.

The head proposes from what the target's verification pass already computed: the target's feature at position t
(the LM head's input, after the output norm) and the embedding of the token at t + 1 (the one the target has just
emitted) give the logits of the token at t + 2 over a vocabulary map (the cheap draft's), and a predicted feature at
t + 1, which the next proposal of a chain reads in place of the target's it does not have yet. It has no KV cache and
no prompt to feed: a proposal costs one small MLP per token (propose/feature_head.py serves it; trained EAGLE-3 style,
on its own chains, by `osd bench feature-head --save-head`, docs/feature-head.md).

Head: Linear(2H -> H) over [feature; embedding], one SiLU-gated MLP block with a residual, RMSNorm (the predicted
feature), an LM head over the map (initialised from the target's own output rows). `inputs` > 1: features of several
target layers, fused by a first projection (EAGLE-3; not served: the serving path keeps the last layer's only).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from osd.errors import InvalidArgument

HEAD_FORMAT = "osd-feature-head/1"


class FeatureHead(nn.Module):
    def __init__(self, hidden: int, inter: int, head_rows: torch.Tensor, inputs: int = 1):
        super().__init__()
        self.hidden, self.inter, self.inputs = hidden, inter, inputs
        self.fuse = nn.Linear(inputs * hidden, hidden, bias=False) if inputs > 1 else None
        self.fc = nn.Linear(2 * hidden, hidden)
        self.norm_in = nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.norm_out = nn.RMSNorm(hidden, eps=1e-6)
        self.head = nn.Linear(hidden, head_rows.shape[0], bias=False)
        with torch.no_grad():
            self.head.weight.copy_(head_rows)
            self.down.weight.mul_(0.1)

    def first_feature(self, target_feature: torch.Tensor) -> torch.Tensor:
        """The target's feature(s) at t -> what the first proposal reads."""
        return target_feature if self.fuse is None else self.fuse(target_feature)

    def step(self, feature: torch.Tensor, embedding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feature (..., H), embedding (..., H) -> (logits over the map (..., M) of the token at t + 2, the predicted
        feature at t + 1 (..., H)): the LM head's input, which the next proposal reads in place of the target's."""
        x = self.fc(torch.cat([feature, embedding], dim=-1))
        gate, up = self.gate_up(self.norm_in(x)).chunk(2, dim=-1)
        predicted = self.norm_out(x + self.down(nn.functional.silu(gate) * up))
        return self.head(predicted), predicted

    def forward(self, feature: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        return self.step(self.first_feature(feature), embedding)[0]


def int8_head(head: FeatureHead, allow_fallback: bool = True) -> FeatureHead | None:
    """A copy of the head with every linear int8 (one scale per output row) on osd's compiled int8 kernel, as the
    draft's int8 serving copy runs (serving_draft.int8_linears); None where the kernels cannot build here."""
    from osd.models import kernels
    from osd.models.serving_draft import int8_linears

    kernel = kernels.rows_linear_int8(allow_fallback=allow_fallback, use="feature head int8 copy")
    if kernel is None:
        return None
    return int8_linears(copy.deepcopy(head).eval(), kernel)


@dataclass
class SavedHead:
    head: FeatureHead
    vocab_ids: torch.Tensor  # (M,) target id of each map row
    meta: dict = field(default_factory=dict)  # what trained it (the bench's config), the target it read


def save_head(path: str | Path, head: FeatureHead, vocab_ids: torch.Tensor, meta: dict | None = None) -> Path:
    """Write a head (float weights, its map, its shape and `meta`) to one file that `load_head` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": HEAD_FORMAT, "hidden": head.hidden, "inter": head.inter, "inputs": head.inputs,
                "vocab_ids": vocab_ids.to(torch.long).clone(), "state_dict": head.state_dict(), "meta": meta or {}},
               path)
    return path


def load_head(path: str | Path, hidden: int | None = None, vocab_size: int | None = None) -> SavedHead:
    """A head saved by `save_head`, checked against the target that will serve it (its hidden size; its vocabulary
    covers the map): InvalidArgument, naming the file, where it does not fit."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgument(f"feature head {str(path)!r}: no such file")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise InvalidArgument(f"feature head {str(path)!r} is not a saved head ({type(e).__name__}: {e})") from e
    if not isinstance(saved, dict) or saved.get("format") != HEAD_FORMAT:
        raise InvalidArgument(f"feature head {str(path)!r} is not a {HEAD_FORMAT} file (osd bench feature-head "
                              "--save-head writes one)")
    if hidden is not None and saved["hidden"] != hidden:
        raise InvalidArgument(f"feature head {str(path)!r} reads features of width {saved['hidden']}, the target's "
                              f"are {hidden}: it was trained on another target")
    vocab_ids = saved["vocab_ids"]
    if vocab_size is not None and len(vocab_ids) and int(vocab_ids.max()) >= vocab_size:
        raise InvalidArgument(f"feature head {str(path)!r} proposes token ids up to {int(vocab_ids.max())}, past the "
                              f"target's vocabulary of {vocab_size}")
    state = saved["state_dict"]
    head = FeatureHead(saved["hidden"], saved["inter"], torch.zeros_like(state["head.weight"]), saved["inputs"])
    head.load_state_dict(state)
    return SavedHead(head.eval(), vocab_ids, saved.get("meta", {}))
