"""`osd bench rows`: what verifying n tokens at once costs on each target backend, against one token.

Speculation pays only where a step over k+1 rows costs much less than k+1 single-token steps. For each backend
configuration (llama.cpp with and without its Q4_K repacking, osd's own Q4_K kernel): seconds of one feed of n = 1..9 tokens after a fixed context (best of `repeats`, warm), and
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


BACKENDS = {  # --backends name -> (label, make(gguf, threads))
    "llama.cpp": ("llama.cpp, Q4_K repacked (default)", lambda gguf, threads: _llama_cpp(gguf, threads, repack=True)),
    "llama.cpp-norepack": ("llama.cpp, no repacking", lambda gguf, threads: _llama_cpp(gguf, threads, repack=False)),
    "osd": ("osd, own Q4_K kernel (q4_runner)", lambda gguf, threads: _q4(gguf)),
}


def _llama_cpp(gguf, threads: int, repack: bool):
    from osd.models.llama_cpp_runner import LlamaCppRunner

    return LlamaCppRunner(gguf, 2048, threads, repack=repack)


def _q4(gguf):
    from osd.models.q4_runner import Q4Runner

    return Q4Runner(gguf, 2048)


def run_rows(target: str, threads: int = 0, context: int = 100, repeats: int = 5,
             backends: tuple[str, ...] = tuple(BACKENDS)) -> dict:
    """Feed costs per backend configuration (`backends`: names of BACKENDS). `threads` also sets torch's threads,
    which the osd kernel runs on (0 = leave them)."""
    from osd.errors import InvalidArgument
    from osd.models.loading import gguf_file

    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise InvalidArgument(f"unknown backends {unknown}: choose among {', '.join(BACKENDS)}")
    if threads:
        torch.set_num_threads(threads)
    gguf = gguf_file(target)
    results = {}
    for name in tqdm(backends, desc="bench rows", unit="config"):
        label, make = BACKENDS[name]
        runner = make(gguf, threads)
        results[label] = {"max_rows": runner.max_rows, **feed_costs(runner, context, 9, repeats)}
        if hasattr(runner, "close"):
            runner.close()
    return {"config": {"target": target, "threads": threads, "context": context, "repeats": repeats,
                       "backends": list(backends), "torch_threads": torch.get_num_threads()},
            "llama_cpp_build": _llama_cpp_build() if any(b.startswith("llama.cpp") for b in backends) else None,
            "backends": results}


def _llama_cpp_build() -> str | None:
    from osd.models.llama_cpp_runner import build_info

    return build_info()
