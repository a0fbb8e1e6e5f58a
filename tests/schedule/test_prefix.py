"""Which free slot a new request takes and whose cached prefix it reuses (schedule/prefix.py), as pure functions.

The bug each case would catch is named in it: a shared template head winning over an empty slot (the prefix later
prompts need overwritten), a copy where the taken slot holds as much, a reuse that counts the prompt's last token
(which must be fed for its logits), least-recently-freed order ignored on a tie."""
from __future__ import annotations

from osd.schedule.prefix import choose_slot, common_prefix

HEAD = [1, 2, 3]  # a chat template's system head: every prompt has it
SCHEMA = HEAD + list(range(100, 140))  # a long prefix that later prompts share


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([5], [6]) == 0


def test_common_prefix_is_the_first_mismatch_on_random_pairs():
    """The bisection against the plain scan, on pairs that share 0..n tokens then differ (or end)."""
    import random

    def scan(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    rng = random.Random(0)
    for _ in range(3000):
        a = [rng.randint(0, 2) for _ in range(rng.randint(0, 40))]
        b = a[: rng.randint(0, len(a))] + [rng.randint(0, 2) for _ in range(rng.randint(0, 6))]
        assert common_prefix(a, b) == common_prefix(b, a) == scan(a, b), (a, b)


def test_a_prompt_sharing_only_the_template_head_takes_an_empty_slot_and_copies_the_head():
    free = {0: SCHEMA + [7, 8], 1: []}
    slot, donor, n = choose_slot(free, {}, HEAD + [50, 51, 52])
    assert (slot, donor, n) == (1, 0, 3)  # slot 0 (the schema) is kept for the next prompt that shares it


def test_a_prompt_sharing_the_long_prefix_reuses_it_and_keeps_the_slot_that_held_it():
    free = {0: SCHEMA + [7, 8], 1: []}
    assert choose_slot(free, {}, SCHEMA + [9, 9]) == (1, 0, len(SCHEMA))


def test_a_slot_holding_a_prefix_of_the_prompt_is_reused_in_place():
    free = {0: [], 1: SCHEMA}
    assert choose_slot(free, {}, SCHEMA + [9, 9]) == (1, 1, len(SCHEMA))  # nothing of slot 1 is lost: no copy


def test_the_prompts_last_token_is_never_reused():
    free = {0: SCHEMA + [9]}
    assert choose_slot(free, {}, SCHEMA + [9]) == (0, 0, len(SCHEMA))


def test_a_running_sequences_longer_prefix_is_copied():
    free = {2: HEAD + [60, 61]}
    assert choose_slot(free, {0: SCHEMA + [5]}, SCHEMA + [70, 71]) == (2, 0, len(SCHEMA))


def test_with_no_empty_slot_the_redundant_one_is_overwritten():
    # slots 0 and 1 hold the same schema (with different tails); slot 2 holds a prefix no other slot has
    free = {2: HEAD + [80, 81, 82, 83, 84, 85], 0: SCHEMA + [7], 1: SCHEMA + [8]}
    slot, donor, n = choose_slot(free, {}, HEAD + [90, 91])
    assert slot in (0, 1) and n == len(HEAD)  # each loses 1 token no other slot holds; slot 2 would lose 6
    assert donor == slot  # every slot holds the head: reused in place, not copied from another


def test_ties_go_to_the_least_recently_freed_slot():
    free = {3: [], 1: [], 2: []}
    assert choose_slot(free, {}, [4, 5, 6]) == (3, 3, 0)
