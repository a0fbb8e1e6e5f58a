"""Verification: target scoring and the pure acceptance rules (greedy and lossless rejection sampling)."""
from osd.verify.acceptance import (
    VerifyOutcome,
    acceptance_beta,
    greedy_verify,
    rejection_verify,
)
from osd.verify.sampling import sample_from, warp_probs

__all__ = ["VerifyOutcome", "acceptance_beta", "greedy_verify", "rejection_verify", "sample_from", "warp_probs"]
