"""`osd draft cost`: what one draft token costs in the decoding loop, per derived-draft shape, against the target.

For each number of kept layers (the first half and the last half of them, e.g. 4 = layers 0,1 + 22,23) and each
LM-head size: the serving copy the engine would use (int8 by default), driven through the same proposer the
engine drafts with (DraftModelProposer: one-token feeds, logits mapped to the target's vocabulary). The median
single-token feed is `t_draft`; the target's own single-token feed (on its auto backend) is measured in the
same run, so c = t_draft / t_target compares numbers taken side by side. Weights come from the real base, but
the vocabulary map is the lowest ids (cost does not depend on which rows the head keeps). Seconds of CPU.
"""
from __future__ import annotations

import statistics
import time

import torch


def layer_set(count: int, depth: int) -> list[int]:
    """`count` layers: the first ceil(count/2) and the last floor(count/2) of a `depth`-layer stack."""
    first = (count + 1) // 2
    return list(range(first)) + list(range(depth - (count - first), depth))


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


RUNNERS = ("glue", "transformers")  # the draft runner the proposer picks (models/glue_draft.py), or the reference


def draft_token_seconds(serving, vocab_ids, vocab_size: int, context: int = 64, tokens: int = 16,
                        clock=time.perf_counter, runner: str = "glue") -> float:
    """Mean seconds of one proposed token (one-token feed + argmax, as target ids), after a prefill of `context`
    tokens, over `tokens` proposals. runner "glue": the runner the proposer picks (the glue runner where the serving
    copy qualifies); "transformers": the transformers forward (models/cached.py), for comparison."""
    from osd.config import SamplingConfig
    from osd.drafts import DraftRegistry
    from osd.models.cached import CachedModel
    from osd.propose import DraftModelProposer

    registry = DraftRegistry()
    registry.publish("cost", serving, vocab_ids)
    proposer = DraftModelProposer(registry, "cost", vocab_size)
    ids = [(1000 + (7 * i) % 5000) % vocab_size for i in range(context)]
    greedy = SamplingConfig(max_new_tokens=tokens + 1)
    proposer.begin(ids)
    if runner == "transformers":
        proposer.runner = CachedModel(serving)
    proposer.propose(ids, 1, greedy)  # prefill (not timed)
    t0 = clock()
    proposer.propose(ids + [0], tokens, greedy)  # every forward feeds one token
    return (clock() - t0) / tokens


def target_token_seconds(target, context: int = 64, tokens: int = 16, clock=time.perf_counter) -> float:
    """Mean seconds of one single-token target feed after `context` tokens."""
    from osd.models.runner import as_runner

    runner = as_runner(target)
    ids = [1000 + (7 * i) % 5000 for i in range(context + tokens)]
    runner.reset()
    runner.feed(ids[:context])
    t0 = clock()
    for t in ids[context:]:
        runner.feed([t])
    return (clock() - t0) / tokens


def run_draft_cost(base: str, target, layer_counts: list[int], vocabs: list[int], quantize: str = "int8",
                   context: int = 64, tokens: int = 16, repeats: int = 3, clock: str = "wall", progress=None,
                   runners: tuple[str, ...] = ("glue",)) -> dict:
    """Rows (layers, vocab, t_draft, c); `target` is a runner or torch model (None: no c).

    Every figure is the minimum over `repeats` rounds (what a token costs when neighbours leave the cores alone),
    the median beside it. clock "cpu": the calling thread's CPU time, which time-slicing on a busy machine does not
    inflate; it sees only work done in this thread, so use it with 1 thread (torch and llama.cpp)."""
    from osd.errors import InvalidArgument
    from osd.models.derived import derive_copy
    from osd.models.loading import load_model
    from osd.models.serving_draft import make_serving_draft

    if not runners or set(runners) - set(RUNNERS):
        raise InvalidArgument(f"draft runners must be among {', '.join(RUNNERS)}; got {','.join(runners)!r}")
    model = load_model(base)
    depth, vocab_size = len(model.model.layers), int(model.config.vocab_size)
    rows, target_times = [], []
    work = [(n, min(v, vocab_size)) for n in layer_counts for v in vocabs]
    for count, vocab in (progress(work, desc="draft cost", unit="shape") if progress else work):
        layers = layer_set(count, depth) if count < depth else list(range(depth))
        serving, vocab_ids = make_serving_draft(derive_copy(model, layers, torch.arange(vocab)), quantize)
        tick = CLOCKS[clock]
        if target is not None:  # interleaved with the draft's: both see the same neighbours on a shared CPU
            target_times.append(target_token_seconds(target, context, tokens, tick))
        for runner in runners:  # interleaved rounds: each runner sees the same neighbours
            times = [draft_token_seconds(serving, vocab_ids, vocab_size, context, tokens, tick, runner)
                     for _ in range(repeats)]
            rows.append({"layers": len(layers), "layer_ids": layers, "vocab": vocab, "runner": runner,
                         "t_draft_ms": 1000 * min(times), "t_draft_median_ms": 1000 * statistics.median(times)})
        del serving
    t_target = min(target_times) if target_times else None
    for row in rows:
        row["c"] = row["t_draft_ms"] / (1000 * t_target) if t_target else None
    return {"config": {"base": base, "quantize": quantize, "context": context, "tokens": tokens, "repeats": repeats,
                       "clock": clock, "threads": torch.get_num_threads(), "runners": list(runners)},
            "t_target_ms": 1000 * t_target if t_target else None,
            "t_target_median_ms": 1000 * statistics.median(target_times) if target_times else None, "rows": rows}
