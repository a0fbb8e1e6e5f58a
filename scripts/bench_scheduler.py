"""The scheduler under closed-loop load, in one process: where a step's time goes, speculative vs target-only.

No HTTP, no tokenizer round trips: `c` requests kept in flight on the engine's scheduler (a new one admitted as one
finishes, as `osd bench serve-vs`'s clients do), the same interleaved code / gsm8k / spider / chat test prompts for
every arm, a new slice of prompts per level, levels in order in one engine per arm (as one server serves them), a
warm-up per arm at each level's load not counted (the first prompt, c copies at once); each level runs every arm in
turn, the order reversed every other level. Per level: output tokens/s, steps, rows (prompt, reused prompt, decode),
sequence steps (JSON), proposals and acceptances, the seconds in propose, the target pass (feed) and commit, and
(JSON) the row costs the allocation read at the level's end beside the decode-only passes it timed, by rows. A level
given more than once is also pooled. Run it alone on the machine. Writes JSON and prints its table (--markdown FILE: also appends it).

    python scripts/bench_scheduler.py --levels 1 2 4 8 --arms spec target-only
    python scripts/bench_scheduler.py --levels 1 8 --arms spec spec-q4 target-only   # + the whole 0.5B's Q4 copy
    python scripts/bench_scheduler.py --levels 1 4 --arms spec spec-q4 spec-q4-fresh target-only  # draft prefix reuse
    python scripts/bench_scheduler.py --levels 1 4 --arms spec spec-int8 target-only  # auto's copy against int8
    python scripts/bench_scheduler.py --levels 4 4 4 4 --arms spec target-only  # a level 4 times: pooled, paired
    python scripts/bench_scheduler.py --levels 4 8 4 8 --arms spec spec-rows-only target-only --no-lookup  # pass model
"""
from __future__ import annotations

import argparse
import collections
import time

from osd.records import emit_report, machine, write_result
from osd_bench.report import table
from osd_bench.serve_compare import interleaved_prompts
from osd.build import build_system
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.data import prompt_ids
from osd.models.loading import load_tokenizer

Q4_DRAFT = {"draft": "bundled:qwen2.5-coder-0.5b", "draft_quantize": "q4"}  # the whole 0.5B, 4-bit
ARMS = {"spec": (6, {}), "target-only": (0, {}),  # k, and what the arm's ModelConfig sets beside the target
        "spec-int8": (6, {"draft_quantize": "int8"}),  # the default draft's int8 copy (spec: the copy auto picks)
        "spec-q4": (6, Q4_DRAFT),
        "spec-q4-fresh": (6, Q4_DRAFT),  # the same, its draft feeding every prompt whole (no draft prefix reuse)
        "spec-rows-only": (6, {})}  # spec, its goodput pricing a pass by rows alone (no sequence or context terms)


def timed(totals: collections.Counter, name: str, f):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
    return wrapper


def closed_loop(engine, prompts: list[list[int]], concurrency: int, max_new_tokens: int) -> int:
    """Keep `concurrency` requests in flight until every prompt is answered -> output tokens."""
    sched, queue, tokens = engine.scheduler, list(prompts), 0
    while queue or sched.running:
        while queue and len(sched.running) < concurrency:
            sched.add(queue.pop(0), SamplingConfig(max_new_tokens=max_new_tokens))
        for seq in sched.step():
            if seq.error is not None:
                raise seq.error
            tokens += len(seq.result.token_ids)
            engine.observe_request(seq.result)  # the lookup's traffic index learns, as the server's worker does
    return tokens


def without_draft_reuse(proposer):
    """The proposer, its draft starting every prompt from an empty cache (the arm as before draft prefix reuse)."""
    for source in getattr(proposer, "sources", [proposer]):
        if hasattr(source, "_start_from"):
            source._start_from = lambda head, s=source: (s.runner.reset(), setattr(s, "held", []))
    return proposer


# per level, from the scheduler's counters; sequence_steps / steps is how many sequences a step advanced on average
COUNTED = ("steps", "rows", "decode_rows", "prefill_rows", "proposed", "accepted", "reused_rows", "sequence_steps")


class Arm:
    """One engine (its own target runner, slots, proposer and policies) and the timers on its scheduler."""

    def __init__(self, name: str, args):
        k, models = ARMS[name]
        system = build_system(ModelConfig(target=args.target, threads=args.threads, **models),
                              SpeculationConfig(k=k, lookup=not args.no_lookup, max_batch=args.max_batch))
        self.name, self.engine, self.totals = name, system.engine, collections.Counter()
        self.engine.calibrate()
        if name == "spec-rows-only":  # the pass model's terms dropped: the curve by rows, at the same live scale
            self.engine.row_costs.calibrate(self.engine.row_costs.seconds, None)
        sched = self.engine.scheduler
        sched._propose = timed(self.totals, "propose_s", sched._propose)
        sched._admit = timed(self.totals, "admit_s", sched._admit)  # the draft's prompt prefill, where it runs
        if name.endswith("-fresh"):  # slot 0 holds the engine's proposer, the others forks made on first use
            proposer_of, sched._proposers[0] = sched._proposer, without_draft_reuse(sched._proposers[0])
            sched._proposer = lambda slot: without_draft_reuse(proposer_of(slot))
        sched._commit = timed(self.totals, "commit_s", sched._commit)
        sched.slots.feed = self._timed_pass(timed(self.totals, "target_pass_s", sched.slots.feed))
        self.by_rows: dict[int, list[float]] = collections.defaultdict(list)  # decode-only passes: rows -> seconds

    def _timed_pass(self, feed):
        """Each target pass of decoding rows only (every row with its logits: what proposals cost), by rows."""
        def wrapper(feeds):
            t0 = time.perf_counter()
            out = feed(feeds)
            if feeds and all(f.n_logits == len(f.tokens) for f in feeds):
                self.by_rows[sum(len(f.tokens) for f in feeds)].append(time.perf_counter() - t0)
            return out
        return wrapper

    def row_costs(self) -> dict:
        """What the allocation read at the end of a level (the fitted RowCosts) beside the passes the level timed."""
        rows, fitted = self.engine.row_costs.fitted()
        measured = {r: {"passes": len(t), "mean_s": sum(t) / len(t)} for r, t in sorted(self.by_rows.items())}
        return {"fitted_s": dict(zip(rows, fitted)), "measured": measured}

    def draft_reused_rows(self) -> int:
        """Prompt positions the drafts of every slot took from a cache instead of feeding (DraftModelProposer)."""
        proposers = [p for p in self.engine.scheduler._proposers.values() if p is not None]
        return sum(getattr(s, "reused_rows", 0) for p in proposers for s in getattr(p, "sources", [p]))

    def level(self, prompts: list[list[int]], concurrency: int, max_new_tokens: int) -> dict:
        stats = self.engine.scheduler.stats
        self.totals.clear()
        self.by_rows.clear()
        before, reused = dict(vars(stats)), self.draft_reused_rows()
        t0 = time.perf_counter()
        tokens = closed_loop(self.engine, prompts, concurrency, max_new_tokens)
        wall = time.perf_counter() - t0
        delta = {key: vars(stats)[key] - before[key] for key in COUNTED}
        delta["draft_reused_rows"] = self.draft_reused_rows() - reused
        print(f"  {self.name:12s} c={concurrency:<3d} {tokens / wall:6.1f} tok/s  steps {delta['steps']}  rows "
              f"{delta['rows']} (prompt {delta['prefill_rows']})  proposed {delta['proposed']} accepted "
              f"{delta['accepted']}", flush=True)
        return {"arm": self.name, "concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens,
                "wall_s": wall, "tokens_per_s": tokens / wall, **delta, **dict(self.totals),
                "row_costs": self.row_costs()}


def run(args, prompts: list[list[int]]) -> list[dict]:
    """Every arm's engine built first; then level by level, each arm in turn (the order reversed every other level,
    so a slow spell of the machine does not fall on one arm's levels only)."""
    arms = [Arm(name, args) for name in args.arms]
    for arm in arms:
        for c in sorted(set(args.levels)):  # warm-up at every level's load: its batched paths run once, not counted
            closed_loop(arm.engine, prompts[:1] * c, c, args.max_new_tokens)
    records = []
    for i, c in enumerate(args.levels):
        batch = prompts[1 + i * args.per_level: 1 + (i + 1) * args.per_level]
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            records.append(arm.level(batch, c, args.max_new_tokens))
    return records


def runs_by_arm(records: list[dict]) -> dict:
    """(arm, c) -> its runs in order (a level given more than once has several)."""
    runs = collections.defaultdict(list)
    for r in records:
        runs[(r["arm"], r["concurrency"])].append(r)
    return runs


def paired(records: list[dict]) -> list[tuple[dict, dict | None]]:
    """Each run with target-only's run at the same place (the same level, the same repeat), or None."""
    runs, seen, out = runs_by_arm(records), collections.Counter(), []
    for r in records:
        i, reference = seen[(r["arm"], r["concurrency"])], runs.get(("target-only", r["concurrency"]), [])
        seen[(r["arm"], r["concurrency"])] += 1
        out.append((r, reference[i] if i < len(reference) else None))
    return out


def report_blocks(records: list[dict]) -> list[str]:
    """The per-level table (each run against target-only's run at the same place: `paired`) and, for repeated
    levels, the pooled one."""
    rows = []
    for r, reference in paired(records):
        rows.append([r["arm"], r["concurrency"], f"{r['tokens_per_s']:.2f}",
                     f"{r['tokens_per_s'] / reference['tokens_per_s']:.3f}" if reference else "-",
                     r["steps"], r["rows"], r["prefill_rows"], r["reused_rows"], r.get("draft_reused_rows", 0),
                     r["proposed"], r["accepted"], f"{r.get('admit_s', 0):.2f}", f"{r.get('propose_s', 0):.2f}",
                     f"{r.get('target_pass_s', 0):.2f}", f"{r.get('commit_s', 0):.2f}"])
    blocks = [table(rows, ["arm", "c", "tokens/s", "x target-only", "steps", "rows", "prompt rows", "reused prompt rows",
                           "draft reused rows", "proposed", "accepted", "admit s", "propose s", "target pass s",
                           "commit s"])]
    return blocks + pooled_table(records)


def pooled(records: list[dict]) -> list[dict]:
    """Per (arm, c) run more than once (a level repeated: `--levels 4 4 4 4`): tokens/s over all its runs together,
    and each run's ratio to target-only's run at the same place in the order (the same prompts, minutes apart at
    most), so a slow spell of the machine shows as spread instead of as a ratio."""
    runs, out = runs_by_arm(records), []
    for (arm, c), group in runs.items():
        reference = runs.get(("target-only", c), [])
        if len(group) < 2:
            continue
        ratios = [r["tokens_per_s"] / t["tokens_per_s"] for r, t in zip(group, reference)] if reference else []
        out.append({"arm": arm, "concurrency": c, "runs": len(group),
                    "tokens_per_s": sum(r["output_tokens"] for r in group) / sum(r["wall_s"] for r in group),
                    "ratios": ratios})
    for row in out:
        reference = next((t for t in out if t["arm"] == "target-only" and t["concurrency"] == row["concurrency"]), None)
        row["x_target_only"] = row["tokens_per_s"] / reference["tokens_per_s"] if reference else None
    return out


def pooled_table(records: list[dict]) -> list[str]:
    rows = [[p["arm"], p["concurrency"], p["runs"], f"{p['tokens_per_s']:.2f}",
             f"{p['x_target_only']:.3f}" if p["x_target_only"] else "-",
             " / ".join(f"{x:.3f}" for x in p["ratios"]) or "-"] for p in pooled(records)]
    if not rows:
        return []
    return [table(rows, ["arm", "c", "runs", "pooled tokens/s", "pooled x target-only",
                         "each run x target-only's run"])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="bundled:qwen2.5-coder-1.5b")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--arms", nargs="+", default=["spec", "target-only"], choices=list(ARMS))
    p.add_argument("--per-level", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-lookup", action="store_true", help="the draft alone (osd serve's default), no n-gram lookup")
    p.add_argument("--out", default="benchmarks/serve/bench-scheduler.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(args.target)
    texts = interleaved_prompts(1 + args.per_level * len(args.levels))
    prompts = [prompt_ids(tokenizer, text) for text in texts]
    records = run(args, prompts)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "markdown")}
    path = write_result({"config": config, "records": records, "pooled": pooled(records)}, args.out)
    blocks = report_blocks(records)
    m = machine()
    description = (f"`python scripts/bench_scheduler.py --levels {' '.join(map(str, args.levels))} --arms "
                   f"{' '.join(args.arms)} --per-level {args.per_level} --out {args.out}`, max_new_tokens "
                   f"{args.max_new_tokens}, max_batch {args.max_batch}, threads {args.threads}, lookup on, greedy; "
                   f"machine: {m['cpu']} ({m['cpu_flags']}), {m['cores']} cores")
    emit_report("The scheduler in-process (`scripts/bench_scheduler.py`)", description, blocks, path,
                args.markdown or None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
