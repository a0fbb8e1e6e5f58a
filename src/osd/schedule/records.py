"""What a step and a request leave behind: what the learner, the metrics and the callers read."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from osd.metrics import SpecCounters


@dataclass
class StepRecord:
    """Everything one verification step knows; what the learner and metrics observe."""

    request_id: str
    draft: tuple[str, int]  # (draft name, version) that proposed
    context: list[int]  # committed tokens before the step; proposal i sits at position len(context)+i
    proposed: list[int]  # (k,) draft tokens
    n_accepted: int
    next_token: int  # recovered (n_accepted < k) or bonus token
    target_logits: torch.Tensor  # (k+1, V) raw target logits; row i predicts proposal i (row k: bonus)
    draft_probs: torch.Tensor | None  # (k, V) warped draft probabilities (sampling only)
    betas: list[float]  # exact acceptance probability at each on-trajectory proposal
    temperature: float
    t_draft: float
    t_target: float
    draft_weights: str | None = None  # fingerprint of the weights this step's proposal ran with (Proposal.weights)
    target_features: torch.Tensor | None = None  # (k+1, H) the LM head's input at each row of target_logits, where a
    # source reads features (propose/feature_head.py; None otherwise)


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    draft: tuple[str, int]
    counters: SpecCounters
    seconds: float
    steps: list[tuple[int, int]] = field(default_factory=list)  # (k, n_accepted) per step
    prefill_seconds: float = 0.0  # of `seconds`: feeding the prompt before the first step
    cached_tokens: int = 0  # prompt tokens served from a slot's cache (prefix reuse), not fed again
    logprobs: list | None = None  # per token of token_ids: verify/logprobs.TokenLogprob (None: not asked for)

    @property
    def stats(self) -> dict:
        s = self.counters.summary()
        s.update(draft=self.draft[0], draft_version=self.draft[1], seconds=self.seconds,
                 new_tokens=len(self.token_ids), wall_tokens_per_second=len(self.token_ids) / self.seconds if self.seconds else None)
        return s
