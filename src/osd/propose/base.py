"""The proposer interface. Variation in drafting (draft model, n-gram, heads) lives behind it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from osd.config import SamplingConfig
from osd.propose.tree import Tree


@dataclass
class Proposal:
    tokens: list[int]  # k proposed ids
    draft_probs: torch.Tensor | None = None  # (k, V) warped draft probabilities (sampling only)
    single_token_seconds: list[float] | None = None  # timings of forwards that fed exactly one token (cost model)
    weights: str | None = None  # fingerprint of the draft weights that made these tokens (None: no weights ran)
    tree: "Tree | None" = None  # set by the scheduler: these tokens as a chain plus other branches (propose/tree.py)
    runners_up: list[list[int]] | None = None  # per depth d, the draft's next-best tokens beside tokens[d] (trees)
    confidence: list[float] | None = None  # per token, the draft's probability of it (schedule/confidence.py)

    @property
    def k(self) -> int:
        return len(self.tokens)

    def cut(self, k: int) -> "Proposal":
        """The first k tokens of this proposal (a draft's proposal drafted further than the allocation verifies)."""
        if k >= self.k:
            return self
        return Proposal(self.tokens[:k], self.draft_probs[:k] if self.draft_probs is not None else None,
                        self.single_token_seconds, self.weights if k else None, None,
                        self.runners_up[:k] if self.runners_up is not None else None,
                        self.confidence[:k] if self.confidence is not None else None)


class Proposer(Protocol):
    name: str
    version: int

    def begin(self, prompt_ids: list[int], prefill: bool = True) -> None:
        """Start a new sequence (pick up the latest draft version, drop old caches). prefill: feed a draft model the
        prompt now; False leaves it to the first proposal, which feeds whatever its cache lacks (a sequence served
        beside others may never be asked to propose)."""

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig, generator) -> Proposal:
        """Propose k tokens continuing `tokens` (the whole committed sequence)."""

    def rollback(self, length: int) -> None:
        """Discard cached state beyond the first `length` tokens."""


def forkable(proposer) -> bool:
    """Whether `proposer.fork()` gives an independent proposer for another sequence (own caches, same drafts)."""
    return callable(getattr(proposer, "fork", None)) and getattr(proposer, "forkable", True)
