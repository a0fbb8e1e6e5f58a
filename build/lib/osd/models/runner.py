"""The one seam between the engine and a model backend.

A runner holds one sequence's KV cache and answers:
  feed(token_ids, n_logits) -> (n_logits, V) float32 logits at the last n_logits positions fed
  rollback(length)          keep the first `length` cached tokens
  reset()                   empty the cache
  length, vocab_size, context_window (0 = unknown), eos_ids
  max_rows (optional)       the most rows one feed may hold with logits bitwise those of 1-row feeds
Backends: the torch reference and training path (models/cached.py, any Hugging Face causal LM), the
quantized llama.cpp path (models/llama_cpp_runner.py, a GGUF) and osd's own Q4_K kernel
(models/q4_runner.py, a Qwen2 GGUF). The engine never knows which. Several sequences at once: models/slots.py.
"""
from __future__ import annotations

from typing import Protocol

import torch

from osd.errors import InvalidArgument
from osd.models.cached import CachedModel
from osd.models.eos import eos_ids_of, eos_token_ids  # noqa: F401 - the runners' and engine's import


class Runner(Protocol):
    length: int
    vocab_size: int
    context_window: int
    eos_ids: set[int]

    def feed(self, token_ids: list[int], n_logits: int = 1) -> torch.Tensor: ...

    def rollback(self, length: int) -> None: ...

    def reset(self) -> None: ...


class PositionCache:
    """reset / rollback for a runner whose preallocated KV cache holds the first `length` positions: rolling back
    moves the length only, and the next feed overwrites what lay beyond it (models/q4_runner.py, glue_draft.py)."""

    length: int = 0

    def reset(self) -> None:
        self.length = 0

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens (the next feed overwrites the rest)."""
        if length < 0:
            raise InvalidArgument(f"rollback length must be >= 0, got {length}")
        self.length = min(self.length, length)

    def _reserve(self, n: int) -> None:
        """Room for n cached positions (a runner whose cache grows overrides it)."""
        if n > self.context_window:
            raise InvalidArgument(f"{n} positions exceed the runner's context of {self.context_window}")

    @torch.inference_mode()
    def copy_prefix_from(self, source: "PositionCache", n: int) -> None:
        """Hold the keys/values of `source`'s first n positions (another runner over the same weights; it is left
        untouched): bitwise what feeding those n tokens would write, since each row is computed alone. A draft's
        prompt prefix shared with what another sequence's draft cached, copied in ~ms instead of fed again."""
        kv = getattr(source, "_kv", None)
        if source is self or kv is None or len(kv) != len(self._kv) or not 0 <= n <= source.length:
            raise InvalidArgument(f"cannot copy {n} cached positions from this runner")
        self._reserve(n)
        copy_positions(kv, self._kv, n)
        self.length = n


def copy_positions(kv_from: list, kv_to: list, n: int) -> None:
    """Per layer (keys, values) of (KV heads, positions, head dim): the first n positions of one cache into another."""
    for (k_from, v_from), (k_to, v_to) in zip(kv_from, kv_to):
        k_to[:, :n] = k_from[:, :n]
        v_to[:, :n] = v_from[:, :n]


def as_runner(target) -> Runner:
    """A runner as given, or a torch causal LM wrapped in the torch runner."""
    if hasattr(target, "feed") and hasattr(target, "rollback"):
        return target
    return CachedModel(target)
