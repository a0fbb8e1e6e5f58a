"""`osd bench observe`: what a learning server pays in its serving thread to observe each step.

Every verification step of a learning server hands the learner the target's logits at the rows it verified; the
serving thread keeps their top-k and the tail's mass (learn/buffer.py `items_of_step`: the training item and, with the
guard, the every-position one) before the next step can start. A server learning off pays nothing of it, so this is
part of what a learning server's step costs beyond its draft's extra rows (docs/archive/LIVE-LEARNING-2026.md).

Measured per sequence-step, by proposals verified (k + 1 rows of logits over the target's vocabulary, from a seeded
normal draw scaled like logits), at a given context: the whole observation (`items_of_step`) and its top-k alone
(`compress`), median over repeats after a warm-up.
"""
from __future__ import annotations

import statistics
import time

import torch

from osd.learn.buffer import items_of_step
from osd.learn.compact import compress
from osd.schedule.records import StepRecord


def step_record(k: int, context: int, vocab: int, generator: torch.Generator, request: str = "r") -> StepRecord:
    """A verification step of one sequence: k proposals all accepted after `context` committed tokens."""
    logits = torch.randn(k + 1, vocab, generator=generator) * 3.0
    return StepRecord(request, ("draft", 1), list(range(1000, 1000 + context)), list(range(5, 5 + k)), k, 7, logits,
                      None, [], 0.0, 0.0, 0.0)


def run_observe(proposals: tuple[int, ...] = (0, 1, 2, 4), context: int = 300, vocab: int = 151936,
                top_k: int = 64, max_context: int = 384, repeats: int = 200, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    by_k = {}
    for k in proposals:
        records = [step_record(k, context, vocab, generator, f"r{i}") for i in range(repeats)]
        for r in records[:5]:  # warm-up: the compiled kernels, the allocator
            items_of_step(r, "all", top_k, max_context, True, 0.0)
            compress(r.target_logits, top_k)
        whole, top = [], []
        positions = 0
        for r in records:
            t0 = time.perf_counter()
            item, _ = items_of_step(r, "all", top_k, max_context, True, 0.0)
            t1 = time.perf_counter()
            compress(r.target_logits, top_k)
            t2 = time.perf_counter()
            whole.append(t1 - t0)
            top.append(t2 - t1)
            positions += len(item.positions)
        by_k[str(k)] = {"rows": k + 1, "observe_ms": 1e3 * statistics.median(whole),
                        "top_k_ms": 1e3 * statistics.median(top), "positions_per_step": positions / len(records)}
    return {"config": {"proposals": list(proposals), "context": context, "vocab": vocab, "top_k": top_k,
                       "max_context": max_context, "repeats": repeats, "seed": seed,
                       "torch_threads": torch.get_num_threads()},
            "per_sequence_step": by_k}
