"""`osd bench rows`: what verifying n tokens at once costs on each target backend, against one token.

Speculation pays only where a step over k+1 rows costs much less than k+1 single-token steps. For each backend
configuration: seconds of one feed of n = 1..9 tokens after a fixed context (best of `repeats`, warm), and
whether each row's logits equal bitwise those of the same position fed alone (greedy identity by construction).
"""
from __future__ import annotations

import time

import torch
from tqdm import tqdm


def feed_costs(runner, context: int = 100, max_n: int = 9, repeats: int = 5) -> dict:
    tokens = [1000 + (7 * i) % 5000 for i in range(context + max_n)]
    runner.reset()
    runner.feed(tokens[: context - 1])
    alone = [runner.feed([t])[0] for t in tokens[context - 1 : context - 1 + max_n]]  # 1-row feeds, position by position
    seconds, invariant = [], []
    for n in range(1, max_n + 1):
        best = float("inf")
        for _ in range(repeats):
            runner.rollback(context - 1)
            t0 = time.perf_counter()
            rows = runner.feed(tokens[context - 1 : context - 1 + n], n_logits=n)
            best = min(best, time.perf_counter() - t0)
        seconds.append(best)
        invariant.append(all(torch.equal(rows[i], alone[i]) for i in range(n)))
    return {"seconds": seconds, "cost_vs_one_row": [s / seconds[0] for s in seconds], "bitwise_invariant": invariant}


def run_rows(target: str, threads: int = 0, context: int = 100, repeats: int = 5) -> dict:
    from osd.models.llama_cpp_runner import LlamaCppRunner, build_info
    from osd.models.loading import gguf_file

    gguf = gguf_file(target)
    configs = {"llama.cpp, Q4_K repacked (default)": dict(repack=True),
               "llama.cpp, no repacking": dict(repack=False)}
    results = {}
    for name, kwargs in tqdm(configs.items(), desc="bench rows", unit="config"):
        runner = LlamaCppRunner(gguf, 2048, threads, **kwargs)
        results[name] = {"max_rows": runner.max_rows, **feed_costs(runner, context, 9, repeats)}
        runner.close()
    return {"config": {"target": target, "threads": threads, "context": context, "repeats": repeats},
            "llama_cpp_build": build_info(), "backends": results}
