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


def test_paired_z_is_the_sign_test_on_flipped_positions():
    from osd.learn.guard import paired_z

    assert paired_z([True, False, False], [False, True, True]) == pytest.approx(1 / 3 ** 0.5)
    assert paired_z([True] * 5, [True] * 5) == 0.0
    assert paired_z([True] * 9 + [False], [False] * 9 + [True]) == pytest.approx(-8 / 10 ** 0.5)


def test_drift_action_keeps_rolls_back_or_resets():
    from osd.learn.guard import drift_action

    base = [True] * 50 + [False] * 50
    slid = [False] * 10 + [True] * 40 + [False] * 50  # lost 10, gained 0: z = -3.2 against the base
    small = [False] * 2 + [True] * 48 + [False] * 50  # lost 2: z = -1.4, within noise
    better = [True] * 60 + [False] * 40  # gained 10
    assert drift_action(base, small) == "keep" and drift_action(base, better) == "keep"
    assert drift_action(base, slid) == "reset"  # no best version but the base
    assert drift_action(base, slid, best=better) == "rollback"
    assert drift_action(base, slid, best=small) == "rollback"  # not significantly below the base, and above `slid`
    assert drift_action(base, small, best=better) == "keep"  # below the best version but not the base: noise allowed
    assert drift_action(base, slid, best=slid) == "reset"  # the best one has slid as well
    assert drift_action(base, slid, z=4.0) == "keep"  # a laxer threshold


def test_drift_rolls_back_only_to_a_best_version_that_holds_more_than_the_current_one():
    """A best version within noise of the base but no better than the current draft (many flips both ways, as many
    right as the current one) is no place to roll back to: reset to the base."""
    from osd.learn.guard import drift_action, paired_z

    base = [True] * 200 + [False] * 200
    current = [False] * 20 + [True] * 180 + [False] * 200  # lost 20, gained 0: z = -4.5
    wide = [False] * 85 + [True] * 115 + [True] * 65 + [False] * 135  # lost 85, gained 65: z = -1.63
    assert paired_z(base, current) < -1.64 <= paired_z(base, wide) and sum(wide) == sum(current)
    assert drift_action(base, current, best=wide) == "reset"
    one_more = wide[:]
    one_more[-1] = True  # one position more right than the current draft (gained 66: still within the base's noise)
    assert drift_action(base, current, best=one_more) == "rollback"
