"""The guard's paired decision (learn/guard.py), alone."""
import pytest

from osd.learn.guard import is_worse, paired_flips


def test_paired_flips_counts_each_direction():
    before = [True, True, False, False, True]
    after = [True, False, True, False, False]
    assert paired_flips(before, after) == (2, 1)


def test_noise_sized_drop_is_not_worse_but_a_clear_drop_is():
    before = [True] * 60 + [False] * 40
    noise = [False] * 3 + [True] * 57 + [True] * 2 + [False] * 38  # lost 3, gained 2: within noise
    assert not is_worse(before, noise)
    assert is_worse(before, noise, z=0.0)  # z = 0: any drop counts
    clear = [False] * 20 + [True] * 40 + [False] * 40  # lost 20, gained 0
    assert is_worse(before, clear)
    assert not is_worse(before, clear, tolerance=0.25)  # a 0.20 drop within a 0.25 tolerance


def test_gains_are_never_worse_and_lengths_must_match():
    assert not is_worse([False] * 10, [True] * 10, z=0.0)
    assert not is_worse([], [], z=0.0)
    with pytest.raises(ValueError, match="differ in length"):
        is_worse([True], [True, False])
