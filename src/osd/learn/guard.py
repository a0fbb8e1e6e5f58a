"""The publication guard's decision: did a candidate update make held-out acceptance worse?

Paired on the same held-out positions: `lost` = positions the old draft got right and the candidate gets
wrong, `gained` = the reverse. With no real change, lost - gained is noise with standard deviation
sqrt(lost + gained) (McNemar). On the small, fresh holdouts an online learner has (tens to hundreds of
positions), "any drop" rejects about half of all harmless updates; a drop counts only when it exceeds
`z` of those standard deviations and `tolerance` in agreement. z = 0 and tolerance = 0: any drop.
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
