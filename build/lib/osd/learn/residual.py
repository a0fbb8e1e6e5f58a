"""Per-mode drafts as residuals on one shared online draft (issue 18).

Per-mode drafts that each learn only their mode's traffic lost to one shared draft on every stream tried
(BENCHMARKS.md, "Routed replay"): what the cheap draft learns from the target is mostly common to the modes, and a
per-mode draft learns it from a fraction of the traffic. A residual draft keeps both: it is the shared draft (which
learns from every request) plus its own optimizer steps on its mode's requests,

    follower = leader + sum of the follower's own steps,

kept by adding every change of the leader's weights to each follower (`Residuals.sync`). The follower's optimizer
steps its own weights; its Adam moments are its own; its guard's references (the base and best versions of the
drift guard) move with the leader too, so a follower that drifts significantly below the leader plus what it had
is rolled back, or reset to the leader itself. With averaging the leader's average and trajectory
are carried over to the follower's average and trajectory alike (`OnlineLearner.weights`), so the follower's
average stays the leader's average plus the average of its own steps.

Cost: one copy of the leader's trainable weights (the point of the last sync), and the followers' optimizer steps
on top of the leader's: a system of residual drafts takes about twice the optimizer steps of the shared draft
alone, which the replay's equal-steps arm accounts for.
"""
from __future__ import annotations

from typing import Iterable

import torch


def fingerprint(learner) -> tuple:
    """What changes whenever the learner's weights may have changed (an update published, rejected or failed, a
    rollback or reset); cheap to compare, so a sync after each request costs nothing when no update ran."""
    c = learner.counters
    return (learner.version, c["optimizer_steps"], c["updates_published"], c["updates_rejected"], c["update_errors"],
            c["rollbacks"], c["resets"])


@torch.no_grad()
def add_difference(targets: Iterable[torch.Tensor], after: Iterable[torch.Tensor], before: Iterable[torch.Tensor]) -> None:
    """targets += after - before, tensor by tensor (shapes must match)."""
    for t, a, b in zip(targets, after, before, strict=True):
        if t.shape != a.shape or a.shape != b.shape:
            raise ValueError(f"residual weights do not match: {tuple(t.shape)} vs {tuple(a.shape)} vs {tuple(b.shape)}")
        t.add_(a.to(t.dtype) - b.to(t.dtype))


class Residuals:
    """Followers that move with a leader: after each leader update, `sync(followers)` adds the leader's weight change
    since the last sync to every follower."""

    def __init__(self, leader):
        self.leader = leader
        self.last = [w.detach().clone() for w in leader.weights()]
        self.seen = fingerprint(leader)

    @torch.no_grad()
    def sync(self, followers: Iterable) -> bool:
        """True when the leader had changed and the followers were moved with it."""
        seen = fingerprint(self.leader)
        if seen == self.seen:
            return False
        now = self.leader.weights()
        for follower in followers:
            with follower.lock():
                follower.move_with(now, self.last)
        for last, w in zip(self.last, now):
            last.copy_(w)
        self.seen = seen
        return True
