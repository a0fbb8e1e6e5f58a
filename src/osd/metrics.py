"""Speculative decoding metrics: monotonic counters first, rates derived when read.

Per (draft name, draft version):
  steps            verification steps (k = 0 steps included)
  proposed         draft tokens proposed
  accepted         draft tokens accepted
  emitted          tokens emitted = accepted + recovered + bonus (truncation at EOS/stop/max aside)
  beta_sum, beta_n exact per-position acceptance probabilities summed over the positions on the
                   output trajectory (proposals up to and including the first rejection)
  proposed_at[i], accepted_at[i]   per proposal position i (0-based)
  draft_seconds, target_seconds    time spent in draft proposals and target verification
Derived: alpha = beta_sum / beta_n (PAPER.md: E[beta]; exact sum-min for T > 0, agreement for T = 0),
acceptance_rate = accepted / proposed, tokens_per_step = emitted / steps.
"""
from __future__ import annotations

import copy
import threading
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class SpecCounters:
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    beta_sum: float = 0.0
    beta_n: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    requests: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    rows: int = 0  # target rows verified (the pending token's, proposals', tree nodes')
    tree_steps: int = 0  # steps that verified a token tree (propose/tree.py)
    tree_tokens: int = 0  # tokens accepted on recycled branches, beyond the chain's accepted prefix

    def add_step(self, k: int, n_accepted: int, n_emitted: int, betas: list[float], t_draft: float, t_target: float) -> None:
        self.steps += 1
        self.proposed += k
        self.accepted += n_accepted
        self.emitted += n_emitted
        self.beta_sum += sum(betas)
        self.beta_n += len(betas)
        self.draft_seconds += t_draft
        self.target_seconds += t_target
        self._grow(k)
        for i in range(k):
            self.proposed_at[i] += 1
            self.accepted_at[i] += int(i < n_accepted)

    def _grow(self, k: int) -> None:
        while len(self.proposed_at) < k:
            self.proposed_at.append(0)
            self.accepted_at.append(0)

    def merge(self, other: "SpecCounters") -> None:
        for name in ("steps", "proposed", "accepted", "emitted", "beta_sum", "beta_n", "draft_seconds", "target_seconds", "requests",
                     "rows", "tree_steps", "tree_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._grow(len(other.proposed_at))
        for i in range(len(other.proposed_at)):
            self.proposed_at[i] += other.proposed_at[i]
            self.accepted_at[i] += other.accepted_at[i]

    def summary(self) -> dict:
        seconds = self.draft_seconds + self.target_seconds
        return {
            "requests": self.requests,
            "steps": self.steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "alpha": self.beta_sum / self.beta_n if self.beta_n else None,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
            "tokens_per_step": self.emitted / self.steps if self.steps else None,
            "rows_per_step": self.rows / self.steps if self.steps else None,
            "tree_steps": self.tree_steps,
            "tree_tokens": self.tree_tokens,
            "per_position_acceptance": [a / p if p else None for a, p in zip(self.accepted_at, self.proposed_at)],
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "draft_time_share": self.draft_seconds / seconds if seconds else None,
            "tokens_per_second": self.emitted / seconds if seconds else None,
        }


class SpecMetrics:
    """Thread-safe counters keyed by (draft name, draft version)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.by_draft: dict[tuple[str, int], SpecCounters] = defaultdict(SpecCounters)

    def record(self, draft: tuple[str, int], counters: SpecCounters) -> None:
        with self._lock:
            self.by_draft[draft].merge(counters)

    def reset(self) -> None:
        with self._lock:
            self.by_draft.clear()

    def counters(self) -> dict[tuple[str, int], SpecCounters]:
        """A consistent copy of the raw counters per (draft name, version)."""
        with self._lock:
            return {key: copy.deepcopy(c) for key, c in self.by_draft.items()}

    def total(self) -> SpecCounters:
        out = SpecCounters()
        with self._lock:
            for c in self.by_draft.values():
                out.merge(c)
        return out

    def snapshot(self) -> dict:
        with self._lock:
            items = list(self.by_draft.items())
        return {f"{name}@v{version}": c.summary() for (name, version), c in sorted(items)}


MIN_STEPS = 32  # a version's figures count once it served this many verification steps


def learning_effect(counters: dict, min_steps: int = MIN_STEPS) -> dict:
    """Learning's effect as it happens, per draft: {draft: {"versions": {version: {"acceptance", "tokens_per_step",
    "steps"}}, "first", "latest", "acceptance_vs_first", "tokens_per_step_vs_first"}}.

    counters: SpecMetrics.counters(), {(draft, version): SpecCounters}. "first" is the draft's lowest version served,
    "latest" the newest with at least `min_steps` steps (the newest at all when none has): the ratios are latest /
    first (None while either is missing). Each version's figures are on the traffic it served (the first version's
    on the earliest requests); the guard's held-out comparison on the same positions is the learner's
    `heldout_agreement_{base,serving}`."""
    by_draft: dict[str, dict] = {}
    for (draft, version), c in sorted(counters.items()):
        by_draft.setdefault(draft, {})[version] = {
            "acceptance": c.accepted / c.proposed if c.proposed else None,
            "tokens_per_step": c.emitted / c.steps if c.steps else None, "steps": c.steps}
    out = {}
    for draft, versions in by_draft.items():
        first = min(versions)
        ripe = [v for v in versions if versions[v]["steps"] >= min_steps]
        latest = max(ripe) if ripe else max(versions)
        ratio = lambda key: (versions[latest][key] / versions[first][key]
                             if versions[latest][key] is not None and versions[first][key] else None)
        out[draft] = {"versions": versions, "first": first, "latest": latest,
                      "acceptance_vs_first": ratio("acceptance"), "tokens_per_step_vs_first": ratio("tokens_per_step")}
    return out
