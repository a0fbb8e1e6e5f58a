"""Prefix reuse across requests: which free slot a new request takes, and whose cached prefix it starts from.

Every slot's cache holds the tokens of the request it served last (free slots) or serves now (running ones); a new
prompt reuses the longest prefix any of them holds, in place where that slot is the one it takes, else copied
(Q4Slots.copy_prefix: bitwise what feeding the tokens would write). The slot it takes is the free one whose
overwriting loses least: the fewest of its tokens that neither the new prompt nor another slot holds. Empty and
redundant slots go first, so a prefix that later prompts share (a schema, few-shot examples) is not overwritten
while a slot holding nothing sits free.

Before, the free slot sharing the longest prefix was taken in place, the first of them on a tie. Every chat prompt
shares its template's system head (24 tokens with the bundled Qwen), so the most recently freed slot always won, and
at 1 to 4 clients the same one or two slots were overwritten again and again while the others stayed empty: in
`scripts/bench_scheduler.py`'s closed loop a spider prompt whose 134-token schema an earlier request had fed reused
24 tokens, and at 4 clients the level's 16 prompts reused ~500 of the ~840 tokens an earlier prompt had fed.
"""
from __future__ import annotations


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share (a bisection over slice comparisons, which run in C: slots holding long
    shared conversations are compared pairwise at each admission)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    shared, differs = 0, n  # a[:shared] == b[:shared], a[:differs] != b[:differs]
    while differs - shared > 1:
        mid = (shared + differs) // 2
        if a[shared:mid] == b[shared:mid]:
            shared = mid
        else:
            differs = mid
    return shared


def choose_slot(free: dict[int, list[int]], running: dict[int, list[int]], prompt: list[int]) -> tuple[int, int, int]:
    """free: each free slot's held tokens, least recently freed first; running: each running slot's cached tokens
    -> (slot to take, donor slot, n): the request reuses the donor's first n positions (donor == slot: in place).

    n is at most len(prompt) - 1: the prompt's last token is fed with the request's first step, for its logits."""
    head = prompt[:-1]
    holders = {**free, **running}
    reuse = {slot: common_prefix(held, head) for slot, held in holders.items()}

    def lost(slot: int) -> int:
        held = free[slot]
        kept = max([reuse[slot]] + [common_prefix(held, other) for s, other in holders.items() if s != slot])
        return len(held) - kept

    slot = min(free, key=lambda s: (lost(s), -reuse[s]))  # on a tie the first: the least recently freed
    donor = max(holders, key=lambda s: (reuse[s], s == slot))  # the slot itself where it holds as much: no copy
    return slot, donor, reuse[donor]
