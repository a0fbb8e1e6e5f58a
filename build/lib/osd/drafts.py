"""Drafts addressable by name and version.

The learner publishes new draft weights here; the engine reads a snapshot at the start of each
request, so a request never sees two versions and a step never sees half-updated weights
(a snapshot is immutable; publishing swaps one reference under a lock).

`weights_fingerprint` names the weights a forward actually ran with, cheaply enough to take at every
propose call: the proposer records it per step (StepRecord.draft_weights), which is how tests show that
no request mixes two versions.
"""
from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftSnapshot:
    name: str
    version: int
    model: object  # serving copy (frozen, maybe quantised); never mutated after publish
    vocab_ids: torch.Tensor | None = None  # (N,) ids the draft's LM head covers; None = full vocab
    published_at: float = field(default_factory=time.time)


class DraftRegistry:
    """Thread-safe name -> latest DraftSnapshot map, with monotonically increasing versions."""

    def __init__(self):
        self._lock = threading.Lock()
        self._drafts: dict[str, DraftSnapshot] = {}

    def publish(self, name: str, model, vocab_ids=None, version: int | None = None) -> DraftSnapshot:
        with self._lock:
            current = self._drafts.get(name)
            next_version = (current.version + 1) if current else 0
            if version is not None:
                next_version = max(version, next_version if current else version)
            snap = DraftSnapshot(name, next_version, model, vocab_ids)
            self._drafts[name] = snap
            return snap

    def get(self, name: str) -> DraftSnapshot:
        with self._lock:
            if name not in self._drafts:
                raise KeyError(f"no draft named {name!r}; known: {sorted(self._drafts)}")
            return self._drafts[name]

    def remove(self, name: str) -> DraftSnapshot:
        """Retire a draft: requests that already hold its snapshot finish with it; later ones cannot get it."""
        with self._lock:
            if name not in self._drafts:
                raise KeyError(f"no draft named {name!r}; known: {sorted(self._drafts)}")
            return self._drafts.pop(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._drafts)


def _probe_module(model):
    """The module whose weights every way of training changes: the last decoder layer's MLP down projection
    (trainable all / no_embeddings / LoRA merged all touch the top layer); the model itself when it has no
    decoder layers we know of."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    mlp = getattr(layers[-1], "mlp", None) if layers is not None and len(layers) else None
    down = getattr(mlp, "down_proj", None)
    return down if isinstance(down, torch.nn.Module) else model


def _plain_tensors(values):
    """state_dict values -> plain tensors (quantized ones dequantized; packed tuples flattened)."""
    for v in values:
        if isinstance(v, (tuple, list)):
            yield from _plain_tensors(v)
        elif isinstance(v, torch.Tensor):
            yield v.dequantize() if v.is_quantized else v


def weights_fingerprint(model, picks: int = 64) -> str:
    """A cheap checksum of the weights `model` holds now: a hash of `picks` evenly spaced values of each tensor of
    one module (see _probe_module). Two serving copies with different trained weights differ here; the cost is a
    few small gathers (no pass over the model). Limitation: only those values are read, so two copies that differ
    elsewhere alone (frozen layers; a change confined to a few unsampled values, which no optimizer step makes)
    share a fingerprint."""
    digest = hashlib.blake2b(digest_size=8)
    for t in _plain_tensors(_probe_module(model).state_dict().values()):
        flat = t.detach().reshape(-1)
        if flat.numel():
            index = torch.arange(min(picks, flat.numel())) * (flat.numel() - 1) // max(1, min(picks, flat.numel()) - 1)
            digest.update(flat[index].double().cpu().numpy().tobytes())  # float64 holds int8 / bf16 / fp32 exactly
    return digest.hexdigest()
