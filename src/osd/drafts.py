"""Drafts addressable by name and version.

The learner publishes new draft weights here; the engine reads a snapshot at the start of each
request, so a request never sees two versions and a step never sees half-updated weights
(a snapshot is immutable; publishing swaps one reference under a lock).
"""
from __future__ import annotations

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
