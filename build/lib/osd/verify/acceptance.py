"""Pure acceptance rules of speculative decoding (PAPER.md section 1).

Vocabulary: a step proposes k draft tokens; the first `n_accepted` are accepted; then one more token
is emitted: "recovered" (drawn at the first rejection) or "bonus" (after all k were accepted).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from osd.verify.sampling import sample_from


@dataclass(frozen=True)
class VerifyOutcome:
    n_accepted: int  # accepted draft tokens, 0..k
    next_token: int  # recovered token (n_accepted < k) or bonus token (n_accepted == k)

    def is_bonus(self, k: int) -> bool:
        return self.n_accepted == k


def greedy_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> VerifyOutcome:
    """Greedy rule: accept draft token i iff it equals the target's argmax at that position.

    target_logits: (k+1, V) target logits predicting draft positions 1..k and the bonus position.
    draft_tokens:  (k,) proposed ids.
    The emitted tokens are exactly the target's own greedy continuation.
    """
    target_choice = target_logits.argmax(dim=-1)  # (k+1,)
    k = draft_tokens.shape[0]
    mismatch = (target_choice[:k] != draft_tokens).nonzero()
    n_accepted = int(mismatch[0, 0]) if mismatch.numel() else k
    return VerifyOutcome(n_accepted, int(target_choice[n_accepted]))


def rejection_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyOutcome:
    """Lossless rejection sampling: output tokens are distributed exactly as the target's.

    target_probs: (k+1, V) warped target probabilities; draft_probs: (k, V) warped draft
    probabilities the proposals were drawn from; draft_tokens: (k,).
    Accept token i with probability min(1, target/draft); at the first rejection draw from
    norm(max(0, target - draft)); if all are accepted draw the bonus from target_probs[k].
    """
    k = draft_tokens.shape[0]
    idx = torch.arange(k)
    p_target = target_probs[idx, draft_tokens]  # (k,)
    p_draft = draft_probs[idx, draft_tokens]  # (k,)
    u = torch.rand(k, generator=generator)
    accept = u * p_draft < p_target  # u < p/q without dividing by zero; strict, as u = 0 occurs (u in [0, 1))
    rejected = (~accept).nonzero()
    if not rejected.numel():
        return VerifyOutcome(k, sample_from(target_probs[k], generator))
    i = int(rejected[0, 0])
    residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)  # (V,)
    total = residual.sum()
    if total <= 0:  # target == draft numerically: rejection has probability ~0; fall back to target
        residual, total = target_probs[i], target_probs[i].sum()
    return VerifyOutcome(i, sample_from(residual / total, generator))


def acceptance_beta(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Exact per-position acceptance probability beta = sum_y min(target, draft) = 1 - TV.

    (n, V), (n, V) -> (n,). Unbiased for alpha, unlike min(p, q) at the sampled token.
    """
    return torch.minimum(target_probs, draft_probs).sum(dim=-1)
