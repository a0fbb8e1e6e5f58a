"""The publication guard's decision: did a candidate update make held-out acceptance worse?

Paired on the same held-out positions: `lost` = positions the old draft got right and the candidate gets
wrong, `gained` = the reverse. With no real change, lost - gained is noise with standard deviation
sqrt(lost + gained) (McNemar). On the small, fresh holdouts an online learner has (tens to hundreds of
positions), "any drop" rejects about half of all harmless updates; a drop counts only when it exceeds
`z` of those standard deviations and `tolerance` in agreement. z = 0 and tolerance = 0: any drop.

A guard that compares each candidate with the previous version only lets small losses accumulate (each one
within the noise); `drift_action` compares the serving draft with the never-trained base (and the best version
so far) on the same held-out positions, and says when to roll back or reset (learn/drift.py keeps those versions).
"""
from __future__ import annotations

import math


def paired_flips(before: list[bool], after: list[bool]) -> tuple[int, int]:
    """(lost, gained) between two per-position correctness lists of the same positions."""
    if len(before) != len(after):
        raise ValueError(f"paired lists differ in length: {len(before)} vs {len(after)}")
    lost = sum(b and not a for b, a in zip(before, after))
    gained = sum(a and not b for b, a in zip(before, after))
    return lost, gained


def is_worse(before: list[bool], after: list[bool], z: float = 1.64, tolerance: float = 0.0) -> bool:
    """True when the candidate (after) is significantly and materially worse than the current draft (before)."""
    lost, gained = paired_flips(before, after)
    drop = (lost - gained) / max(1, len(before))
    return drop > tolerance and lost - gained > z * math.sqrt(lost + gained)


def paired_z(before: list[bool], after: list[bool]) -> float:
    """Sign-test z of `after` against `before` on the same positions: (gained - lost) / sqrt(gained + lost); 0 when
    nothing flipped. Negative: `after` is worse."""
    lost, gained = paired_flips(before, after)
    return flips_z(gained, lost)


def flips_z(gained: int, lost: int) -> float:
    """The sign test's z from flip counts (pooled over several comparisons too): (gained - lost) / sqrt(gained +
    lost); 0 when nothing flipped."""
    return (gained - lost) / math.sqrt(gained + lost) if gained + lost else 0.0


DRIFT_ACTIONS = ("keep", "rollback", "reset")


def drift_action(base: list[bool], current: list[bool], best: list[bool] | None = None, z: float = 1.64) -> str:
    """What to do with the draft that serves (`current`), from its correctness on held-out positions next to the
    never-trained base's and the best version's so far (best = None: the base is the best so far).

    "keep" unless it is significantly below the base (paired z < -z); then "rollback" to the best version when that
    one is not significantly below the base and is better than `current`, else "reset" to the base. This catches
    drift that no single update's guard sees: each update may lose a little (within the per-update noise) while the
    losses add up against the base. (Triggering on "significantly below the best version" too was tried: on a
    helpful stream it fired on noise, the best version being the luckiest of many on overlapping holdouts.)"""
    if paired_z(base, current) >= -z:
        return "keep"
    if best is not None and paired_z(base, best) >= -z and sum(best) > sum(current):
        return "rollback"
    return "reset"
