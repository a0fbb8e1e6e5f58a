"""`osd bench serve` results: JSON (with git revision and machine), a console table, a BENCHMARKS.md block."""
from __future__ import annotations

import sys

from osd.bench.record import emit_report, machine, redacted_command, write_result
from osd.bench.serve_load import optimizer_steps

COLUMNS = [("concurrency", "concurrency"), ("requests", "requests"), ("errors", "errors"),
           ("tokens_per_second", "tokens/s"), ("requests_per_second", "req/s"), ("ttft_p50", "TTFT p50 s"),
           ("ttft_p95", "TTFT p95 s"), ("tpot_p50", "TPOT p50 s"), ("tpot_p95", "TPOT p95 s"),
           ("acceptance_rate", "acceptance"), ("tokens_per_step", "tokens/step")]


def load_table(result: dict) -> str:
    from osd.bench.report import table

    rows = [[level[key] for key, _ in COLUMNS] for level in result["levels"]]
    return table(rows, [title for _, title in COLUMNS])


def routing_lines(result: dict) -> list[str]:
    """A routing server: its routing + scoring seconds per level (share of the level's wall time) and the drafts'
    memory against one draft."""
    lines = [f"- concurrency {lv['concurrency']}: routing {lv['routing']['route_seconds']:.2f} s + scoring "
             f"{lv['routing']['score_seconds']:.2f} s of {lv['wall_seconds']:.1f} s wall = {100 * lv['routing']['share']:.2f}%"
             for lv in result["levels"] if lv.get("routing")]
    memory = result.get("drafts_memory")
    if memory:
        lines.append(f"- drafts' tensor memory {memory['total_bytes'] / 2**30:.2f} GiB = {memory['ratio']:.3f}x one draft "
                     f"({memory['one_draft_bytes'] / 2**30:.2f} GiB: its master weights and serving copy)")
    return lines


def report_load(result: dict, out: str, markdown: str) -> None:
    path = write_result(result, out)
    t = load_table(result)
    routing = routing_lines(result)
    cfg, m = result["config"], machine()
    emit_report("Serving load (`osd bench serve`)",
                f"`{redacted_command(sys.argv[1:])}` against {cfg['model']} at {cfg['url']}: {cfg['prompts']} prompts per "
                f"level, max_tokens={cfg['max_tokens']}, greedy, {'chat' if cfg['chat'] else 'completions'} endpoint, "
                f"streaming, warm-up excluded; machine (client side): {m['cpu']}, {m['cores']} cores",
                [t, "Routing server (from its /metrics):\n" + "\n".join(routing)] if routing else [t], path, markdown)


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_round(row: dict) -> None:
    on, off = row["learning"], row["paused"]
    print(f"round {row['round']}: TPOT p50 learning {_fmt(on['tpot_p50'])} s, paused {_fmt(off['tpot_p50'])} s; "
          f"optimizer steps in the learning round {optimizer_steps(on)}",
          flush=True)


def paired_table(result: dict) -> str:
    from osd.bench.report import table

    rows = []
    for r in result["rounds"]:
        on, off = r["learning"], r["paused"]
        rows.append([r["round"], "learning first" if r["round"] % 2 == 0 else "paused first", on["tpot_p50"],
                     off["tpot_p50"], on["tpot_p50"] / off["tpot_p50"] if on["tpot_p50"] and off["tpot_p50"] else None,
                     optimizer_steps(on), on["acceptance_rate"], off["acceptance_rate"], on["errors"] + off["errors"]])
    return table(rows, ["round", "order", "TPOT p50 learning s", "TPOT p50 paused s", "ratio", "optimizer steps",
                        "acceptance learning", "acceptance paused", "errors"])


def report_paired(result: dict, out: str, markdown: str) -> None:
    path = write_result(result, out)
    cfg, m, ratio = result["config"], machine(), result["tpot_p50_ratio"]
    ci = ratio["ci95"]
    summary = (f"Learning vs paused, p50 TPOT ratio over {ratio['rounds']} round pairs: {_fmt(ratio['ratio'])} "
               f"(95% interval {_fmt(ci[0]) if ci else '-'} .. {_fmt(ci[1]) if ci else '-'}; learning slower in "
               f"{ratio['on_slower_rounds']} of {ratio['rounds']} rounds); optimizer steps while learning "
               f"{result['optimizer_steps_learning']}, while paused {result['optimizer_steps_paused']}; "
               f"{result['pause_wait_seconds']:.1f} s of learning work finished inside pause requests (counted in no round) "
               f"against {result['learning_wall_seconds']:.1f} s of learning rounds")
    emit_report("Serving load (`osd bench serve`)",
                f"`{redacted_command(sys.argv[1:])}` against {cfg['model']} at {cfg['url']}: one learning server, "
                f"{cfg['rounds']} round pairs of {cfg['prompts']} prompts, learner running vs paused, alternating order, "
                f"concurrency {cfg['concurrency']}, max_tokens={cfg['max_tokens']}, greedy, "
                f"{'chat' if cfg['chat'] else 'completions'} endpoint, streaming, warm-up excluded; machine: {m['cpu']}, "
                f"{m['cores']} cores", [paired_table(result), summary], path, markdown)
