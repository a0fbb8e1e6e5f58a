"""Several sequences on one Q4 runner's weights, for the teacher: greedy answers to many prompts at once.

Filling a teacher cache (healing a draft, `osd replay --fast`, `osd distill`) decodes the target greedily on hundreds
of prompts, one token per forward. One row is memory-bound on this kernel: 8 rows cost ~1.7x one (`osd bench rows`),
so a forward that takes the next token of 8 sequences at once gives ~4-5x the tokens per second of one sequence.

`Q4Batch` holds one KV cache per slot beside a `Q4Runner` (models/q4_runner.py) and feeds rows of several slots in
one forward (`Q4Runner.forward_rows`): the matrices see every row in one pass over each weight; norms, RoPE, the cache
write and attention run per row on that row's own sequence. Since each row's result is bitwise independent of the
other rows (the kernel is row-invariant, the glue runs row by row), an answer decoded in a batch is bitwise the one
`greedy_answer` decodes alone, logits included (tests/models/test_q4_batch.py): the cache holds the target's own
greedy outputs, whatever the batch.

`greedy_many` is the driver: `slots` prompts in flight; a slot whose answer ends takes the next prompt (its prompt
prefilled alone, in the runner's chunks), and every step decodes one token of each busy slot together. Runners
without `forward_rows` (llama.cpp, whose logits change with the batch size; torch) get the one-prompt-at-a-time loop.
Limitations: greedy only; a slot's cache is reserved for `n_ctx` positions (float32, ~57 KB per position for the
bundled 1.5B: 512 positions x 8 slots ~ 0.23 GB).
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from osd.models.q4_runner import Q4Runner
from osd.models.slots import Feed, Q4Slots


class Q4Batch:
    """`slots` independent sequences (KV caches) over one Q4Runner's weights: the scheduler's Q4Slots (models/slots.py,
    every slot its own cache) behind a slot -> tokens interface."""

    def __init__(self, runner: Q4Runner, slots: int, n_ctx: int | None = None):
        self.runner = runner
        self.slots = Q4Slots(runner, slots, n_ctx, exclusive=True)
        self.window = self.slots.context_window

    @property
    def lengths(self) -> list[int]:
        return [self.slots.length(slot) for slot in range(self.slots.n_slots)]

    def reset(self, slot: int) -> None:
        self.slots.reset(slot)

    def feed(self, feeds: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Append tokens to each named slot's sequence in one forward -> slot: (V,) logits at its last fed position."""
        named = [(slot, tokens) for slot, tokens in feeds.items() if tokens]
        logits = self.slots.feed([Feed(slot, tokens, 1) for slot, tokens in named])
        return {slot: rows[0] for (slot, _), rows in zip(named, logits)}

    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        """Start the slot's sequence with `tokens` (alone, in the runner's chunks) -> (V,) logits after the last."""
        self.reset(slot)
        step = self.runner.chunk_rows
        for start in range(0, len(tokens), step):
            logits = self.feed({slot: tokens[start : start + step]})[slot]
        return logits


def greedy_many(runner, prompts: list[list[int]], max_tokens: list[int], eos_ids: set[int],
                keep: Callable[[torch.Tensor], object], slots: int = 8) -> Iterator[tuple[int, list[int], list]]:
    """Greedy answers to `prompts` -> yields (index, answer, [keep(logits (1, V)) per answer position]) as each ends.

    An answer stops after an EOS token or at its max_tokens. With a Q4Runner, `slots` prompts decode together
    (bitwise the answers each would get alone); any other runner decodes one prompt at a time, in order."""
    if not isinstance(runner, Q4Runner) or slots <= 1:
        for i, prompt in enumerate(prompts):
            yield (i, *greedy_alone(runner, prompt, max_tokens[i], eos_ids, keep))
        return
    longest = max((len(p) + m for p, m in zip(prompts, max_tokens)), default=1)
    batch = Q4Batch(runner, min(slots, max(len(prompts), 1)), n_ctx=longest)
    queue = iter(range(len(prompts)))
    busy: dict[int, list] = {}  # slot -> [index, answer, kept, logits of the next position]

    def start(slot: int) -> bool:
        i = next(queue, None)
        if i is None:
            return False
        busy[slot] = [i, [], [], batch.prefill(slot, prompts[i])]
        return True

    for slot in range(batch.slots.n_slots):
        start(slot)
    while busy:
        feeds = {}
        for slot in list(busy):
            i, answer, kept, logits = busy[slot]
            kept.append(keep(logits[None]))
            answer.append(int(logits.argmax()))
            if answer[-1] in eos_ids or len(answer) >= max_tokens[i]:
                del busy[slot]
                yield i, answer, kept
                start(slot)
            else:
                feeds[slot] = answer[-1:]
        for slot, logits in batch.feed(feeds).items():
            busy[slot][3] = logits


def greedy_alone(runner, prompt: list[int], max_tokens: int, eos_ids: set[int], keep) -> tuple[list[int], list]:
    """One prompt's greedy answer on any runner -> (answer, [keep(logits (1, V)) per answer position])."""
    runner.reset()
    logits = runner.feed(prompt)  # (1, V)
    answer, kept = [], []
    for _ in range(max_tokens):
        kept.append(keep(logits))
        answer.append(int(logits[0].argmax()))
        if answer[-1] in eos_ids or len(answer) == max_tokens:
            break
        logits = runner.feed(answer[-1:])
    return answer, kept
