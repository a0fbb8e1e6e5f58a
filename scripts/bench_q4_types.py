"""Rough per-token cost of the kernel's matrix types at one real shape, side by side (models/q4.py).

    PYTHONPATH=src python scripts/bench_q4_types.py [--n 8960] [--k 1536] [--rows 1,2,4,8] [--isa avx512_vnni,avx2]

One thread, its CPU time (time.thread_time), best of `--repeats`, random weights in the kernel's layout (speed does
not depend on the values) rotated over copies of at least 96 MB so they stream from memory as a forward's would.
Prints ms per call and the ratio to Q4_K per row count, and bytes per weight. A shared machine: rough figures.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from osd.models import q4

STREAM_BYTES = 96e6


def random_weight(type_name: str, n: int, k: int, gen: torch.Generator):
    """Random tensors of the shapes and dtypes `q4.repack` gives for this type (learned from a tiny repack)."""
    cls = q4.WEIGHTS[type_name]
    weights, size = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20)}.get(type_name, (256, None))
    size = size or {"Q4_K": q4.Q4K_BLOCK_BYTES, "Q5_K": q4.Q5K_BLOCK_BYTES, "Q6_K": q4.Q6K_BLOCK_BYTES}[type_name]
    probe = q4.repack(torch.zeros(16, 256 // weights * size, dtype=torch.uint8), type_name)
    tb = -(-n // q4.TILE) * (k // q4.QK)
    tensors = []
    for t in probe.tensors():
        if t.dtype == torch.float16:
            tensors.append((torch.rand(tb, t.shape[1], generator=gen) * 0.01).half())
        else:
            tensors.append(torch.randint(0, 64, (tb, t.shape[1]), dtype=torch.uint8, generator=gen).view(t.dtype))
    return cls(n, *tensors)


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8960)
    p.add_argument("--k", type=int, default=1536)
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--isa", default="avx512_vnni,avx2")
    p.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0,Q4_0,Q4_1")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    isas = [i for i in args.isa.split(",") if i != "avx512_vnni" or q4.has_vnni()]
    out = []
    for type_name in args.types.split(","):
        first = random_weight(type_name, args.n, args.k, gen)
        copies = [first] + [random_weight(type_name, args.n, args.k, gen) for _ in range(int(STREAM_BYTES // first.nbytes))]
        for isa in isas:
            ms = []
            for m in rows:
                acts = q4.quantize_activations(torch.randn(m, args.k, generator=gen))
                ms.append(1e3 * best_seconds(lambda: [q4.matmul(acts, w, isa) for w in copies], args.repeats) / len(copies))
            out.append({"type": type_name, "isa": isa, "bits_per_weight": 8 * first.nbytes / (args.n * args.k),
                        "ms": dict(zip(rows, ms))})
        del copies
    for isa in isas:
        base = next(r for r in out if r["type"] == "Q4_K" and r["isa"] == isa)["ms"] if "Q4_K" in args.types else None
        print(f"{isa}  N={args.n} K={args.k}  ms per call (x Q4_K)  1 thread, CPU time, best of {args.repeats}")
        for r in (r for r in out if r["isa"] == isa):
            cells = "  ".join(f"{m} rows {t:6.3f}" + (f" ({t / base[m]:.2f}x)" if base else "") for m, t in r["ms"].items())
            print(f"  {r['type']:5s} {r['bits_per_weight']:5.2f} bits/w  {cells}")
    machine = open("/proc/cpuinfo").read().split("model name", 1)[1].split("\n")[0].split(":", 1)[1].strip()
    print(json.dumps({"machine": machine,
                      "n": args.n, "k": args.k, "results": out}))


if __name__ == "__main__":
    main()
