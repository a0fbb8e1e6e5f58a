"""The chance a draft token is accepted, read from the draft's own probability of it (its confidence).

A draft learnt on the traffic knows where it is sure. On held-out code requests (test split 300-399, the bundled
target's greedy answers, 6,400 positions, the serving q4 copies; `osd eval`,
benchmarks/learning/eval-draft-confidence-code-test300-intel.json), the cheap draft `osd replay` learnt on requests
0-299 agreed with the target on 0.953 of the positions where its own top probability was >= 0.95 (0.192 of them) and
on 0.156 of those under 0.3 (0.243); the shipped draft, less calibrated, 0.837 and 0.085 (0.101 and 0.278 of the
positions). A sequence's average acceptance
(0.3-0.5) cannot tell those tokens apart: the goodput allocation then verifies a row where a token is likely to fail
and leaves one out where it is almost sure. So the scheduler drafts first and allocates after
(schedule/scheduler.py), from each drafted token's chance here.

The chance of a confidence p is the acceptance measured at confidences like it (`bins` equal bins over [0, 1]),
counted with a forgetting window per bin (the draft's versions change its calibration), and shrunk towards p itself
(`prior_weight` tokens): a bin with no evidence takes the draft at its word. Only verified tokens teach it: each
proposal's tokens up to the first rejection (those after it were never judged).
"""
from __future__ import annotations


class ConfidenceBins:
    """Acceptance by the draft's probability of its proposed token, per bin of that probability."""

    def __init__(self, bins: int = 20, prior_weight: float = 2.0, window: float = 200.0):
        if bins < 1 or prior_weight <= 0 or window < 1:
            raise ValueError("ConfidenceBins needs bins >= 1, prior_weight > 0 and window >= 1")
        self.bins, self.prior_weight, self.keep = bins, prior_weight, 1.0 - 1.0 / window
        self.accepted = [0.0] * bins
        self.seen = [0.0] * bins

    def _bin(self, p: float) -> int:
        return min(max(int(p * self.bins), 0), self.bins - 1)

    def chance(self, p: float) -> float:
        """The estimated chance that a proposed token the draft gave probability p is accepted."""
        b = self._bin(p)
        return (self.accepted[b] + self.prior_weight * p) / (self.seen[b] + self.prior_weight)

    def chain(self, confidences: list[float]) -> list[float]:
        """The chance that the first d + 1 tokens of a proposal are all accepted, for each depth d."""
        out, running = [], 1.0
        for p in confidences:
            running *= self.chance(p)
            out.append(running)
        return out

    def observe(self, confidences: list[float], n_accepted: int) -> None:
        """A verified proposal: its first n_accepted tokens accepted, the next one (if proposed) rejected."""
        for depth, p in enumerate(confidences[: n_accepted + 1]):
            b = self._bin(p)
            self.accepted[b] = self.keep * self.accepted[b] + (depth < n_accepted)
            self.seen[b] = self.keep * self.seen[b] + 1.0

    def table(self) -> list[dict]:
        """Per bin with evidence: its range, the tokens seen (forgetting applied) and their acceptance."""
        return [{"bin": f"[{b / self.bins:.2f}, {(b + 1) / self.bins:.2f})", "seen": round(self.seen[b], 1),
                 "acceptance": self.accepted[b] / self.seen[b]} for b in range(self.bins) if self.seen[b] >= 1]
