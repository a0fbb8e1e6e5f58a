"""`osd bench serve` results: JSON (with git revision and machine), a console table, a BENCHMARKS.md block."""
from __future__ import annotations

import sys

from osd.bench.record import emit_report, machine, redacted_command, write_result

COLUMNS = [("concurrency", "concurrency"), ("requests", "requests"), ("errors", "errors"),
           ("tokens_per_second", "tokens/s"), ("requests_per_second", "req/s"), ("ttft_p50", "TTFT p50 s"),
           ("ttft_p95", "TTFT p95 s"), ("tpot_p50", "TPOT p50 s"), ("tpot_p95", "TPOT p95 s"),
           ("acceptance_rate", "acceptance"), ("tokens_per_step", "tokens/step")]


def load_table(result: dict) -> str:
    from osd.bench.report import table

    rows = [[level[key] for key, _ in COLUMNS] for level in result["levels"]]
    return table(rows, [title for _, title in COLUMNS])


def report_load(result: dict, out: str, markdown: str) -> None:
    path = write_result(result, out)
    t = load_table(result)
    cfg, m = result["config"], machine()
    emit_report("Serving load (`osd bench serve`)",
                f"`{redacted_command(sys.argv[1:])}` against {cfg['model']} at {cfg['url']}: {cfg['prompts']} prompts per "
                f"level, max_tokens={cfg['max_tokens']}, greedy, {'chat' if cfg['chat'] else 'completions'} endpoint, "
                f"streaming, warm-up excluded; machine (client side): {m['cpu']}, {m['cores']} cores", [t], path, markdown)
