"""`osd bench passes`: what one target pass costs by its rows, its sequences and the context they attend to.

The scheduler's goodput (schedule/goodput.py `RowCosts`) prices a pass as a curve by rows, measured on one sequence
at a short context, plus what the pass's sequences add: each sequence beyond the first, each cache a sequence reads,
each row's attention over its context. This times a grid of passes on osd's Q4 kernel (every sequence `rows_each`
rows at the same cached length; best of `repeats`, warm), fits those terms on the grid (`fit_pass_model`) and
reports, per pass, the seconds measured beside the model's and beside the curve by rows alone.
"""
from __future__ import annotations

import itertools
import time

import torch
from tqdm import tqdm

CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64)  # one sequence's rows at the shortest context: the curve the model builds on


def run_passes(target: str, contexts: tuple[int, ...] = (64, 500), sequences: tuple[int, ...] = (1, 2, 4, 8),
               rows_each: tuple[int, ...] = (1, 2, 4, 8), repeats: int = 3, threads: int = 0) -> dict:
    from osd.models.loading import gguf_file
    from osd.models.q4_runner import Q4Runner
    from osd.models.slots import Feed, Q4Slots
    from osd.schedule.goodput import RowCosts, fit_pass_model

    if threads:
        torch.set_num_threads(threads)
    runner = Q4Runner(gguf_file(target), 2048)
    n = max(sequences)
    slots = Q4Slots(runner, n, max(contexts) + max(CURVE_ROWS) + 1)
    tokens = torch.randint(0, min(runner.vocab_size, 1000), (max(contexts) + max(CURVE_ROWS),),
                           generator=torch.Generator().manual_seed(0))
    tokens = tokens.tolist()
    shapes = [(c, s, r) for c in contexts for s, r in itertools.product(sequences, rows_each)]
    shapes += [(min(contexts), 1, r) for r in CURVE_ROWS if (min(contexts), 1, r) not in shapes]
    seconds: dict[tuple[int, int, int], float] = {}
    for context in contexts:
        slots.reset(0)
        slots.feed([Feed(0, tokens[:context], 0)])
        for slot in range(1, n):
            slots.copy_prefix(0, slot, context)
        for _ in tqdm(range(repeats + 1), desc=f"bench passes: {context} cached tokens", unit="round"):  # round 0 warms
            for c, s, r in shapes:
                if c != context:
                    continue
                t0 = time.perf_counter()
                slots.feed([Feed(slot, tokens[context : context + r], r) for slot in range(s)])
                t = time.perf_counter() - t0
                for slot in range(s):
                    slots.rollback(slot, context)
                if (_ or not repeats) and t < seconds.get((c, s, r), float("inf")):
                    seconds[(c, s, r)] = t
    base = min(contexts)
    curve = RowCosts()
    curve.calibrate({r: seconds[(base, 1, r)] for r in CURVE_ROWS})
    model = fit_pass_model([([c] * s, s * r, t) for (c, s, r), t in seconds.items()], curve.curve, base)
    priced = RowCosts()
    priced.calibrate(curve.seconds, model)
    grid = [{"context": c, "sequences": s, "rows_each": r, "rows": s * r, "seconds": t,
             "model_seconds": priced.at([c] * s)(s * r), "rows_only_seconds": curve.curve(s * r)}
            for (c, s, r), t in sorted(seconds.items())]
    error = {name: sum(abs(g[name] - g["seconds"]) / g["seconds"] for g in grid) / len(grid)
             for name in ("model_seconds", "rows_only_seconds")}
    return {"config": {"target": target, "contexts": list(contexts), "sequences": list(sequences),
                       "rows_each": list(rows_each), "repeats": repeats, "threads": threads,
                       "torch_threads": torch.get_num_threads()},
            "pass_model": model, "mean_abs_relative_error": error, "grid": grid}
