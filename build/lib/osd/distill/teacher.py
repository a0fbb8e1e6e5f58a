"""The teacher: the target's answers and its distribution at every answer position (healing, caches, benchmarks).

On osd's Q4 runner several prompts decode together, each bitwise as alone (models/q4_batch.py); other runners
answer one prompt at a time.
"""
from __future__ import annotations

import torch

from osd.learn.compact import CompactDist, compress
from osd.models.q4_batch import greedy_alone, greedy_many


@torch.no_grad()
def score_answer(runner, prompt: list[int], answer: list[int], top_k: int) -> CompactDist:
    """The target's distribution at each answer position: one prefill, logits at the last len(answer) positions."""
    runner.reset()
    logits = runner.feed(prompt + answer[:-1], n_logits=len(answer))  # (R, V): row j predicts answer[j]
    return compress(logits, top_k)


@torch.no_grad()
def greedy_answer(runner, prompt: list[int], max_tokens: int, eos_ids: set[int], top_k: int):
    """The target's greedy answer (stops after an EOS token) and its distribution at each answer position."""
    answer, dists = greedy_alone(runner, prompt, max_tokens, eos_ids, lambda logits: compress(logits, top_k))
    return answer, CompactDist.cat(dists)


@torch.no_grad()
def greedy_answers(runner, prompts: list[list[int]], max_tokens: list[int], eos_ids: set[int], top_k: int,
                   slots: int = 8):
    """greedy_answer for many prompts -> yields (index, answer, CompactDist) as each ends. On osd's Q4 runner
    `slots` prompts decode together, bitwise as each would alone (models/q4_batch.py); else one at a time."""
    for i, answer, dists in greedy_many(runner, prompts, max_tokens, eos_ids, lambda l: compress(l, top_k), slots):
        yield i, answer, CompactDist.cat(dists)
