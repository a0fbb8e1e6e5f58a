"""Microbenchmark of rows_linear_int8: the AVX2 path (fp32 activations) vs the AVX-512 VNNI path, 1-9 rows.

One thread, thread CPU time (robust to other processes on a shared machine), best of 20 calls, min of 3
alternations; shapes of the 0.5B draft's MLP (896x4864 and 4864x896 as (N, K)). Takes seconds:
    PYTHONPATH=src .venv/bin/python scripts/bench_rows_int8.py
"""
import time

import torch

from osd.models import kernels


def best_ms(f, reps: int = 20) -> float:
    f()
    best = float("inf")
    for _ in range(reps):
        start = time.thread_time()
        f()
        best = min(best, time.thread_time() - start)
    return best * 1e3


def main() -> None:
    module = kernels.load()
    vnni = kernels.vnni_available()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for n, k in ((896, 4864), (4864, 896)):
        w, scale = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)
        print(f"W {n}x{k} int8 (ms, 1 thread){'' if vnni else ' - no AVX-512 VNNI here'}")
        for rows in range(1, 10):
            x = torch.randn(rows, k)
            avx2 = min(best_ms(lambda: module.rows_linear_int8(x, w, scale)) for _ in range(3))
            line = f"  rows={rows}  avx2 {avx2:7.3f}"
            if vnni:
                fast = min(best_ms(lambda: module.rows_linear_int8(x, w, scale, None, True)) for _ in range(3))
                line += f"  vnni {fast:7.3f}  ({avx2 / fast:.2f}x)"
            print(line)


if __name__ == "__main__":
    main()
