"""One verification step as a pure function: the target's logits at the proposed positions -> what is accepted."""
from __future__ import annotations

import torch

from osd.config import SamplingConfig
from osd.verify.acceptance import VerifyOutcome, acceptance_beta, greedy_verify, rejection_verify
from osd.verify.sampling import warp_probs


def verify_proposal(target_logits: torch.Tensor, tokens: list[int], draft_probs: torch.Tensor | None,
                    sampling: SamplingConfig, generator=None) -> tuple[VerifyOutcome, list[float]]:
    """target_logits (k+1, V) raw, tokens (k,) proposed, draft_probs (k, V) warped (sampling only)
    -> (outcome, betas): greedy or lossless rejection sampling, plus the exact acceptance probability at each
    proposal on the output trajectory (up to and including the first rejection)."""
    draft_tokens = torch.tensor(tokens, dtype=torch.long)  # (k,)
    k = len(tokens)
    if sampling.greedy:
        outcome = greedy_verify(target_logits, draft_tokens)
        on_path = min(outcome.n_accepted + 1, k)
        return outcome, [1.0] * outcome.n_accepted + [0.0] * (on_path - outcome.n_accepted)
    target_probs = warp_probs(target_logits, sampling.temperature, sampling.top_k, sampling.top_p)  # (k+1, V)
    if k == 0:
        return rejection_verify(target_probs, target_probs[:0], draft_tokens, generator), []
    outcome = rejection_verify(target_probs, draft_probs, draft_tokens, generator)
    on_path = min(outcome.n_accepted + 1, k)
    return outcome, acceptance_beta(target_probs[:on_path], draft_probs[:on_path]).tolist()
