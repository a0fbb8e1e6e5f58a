"""`osd bench serve` results: JSON (with git revision and machine), a console table, a BENCHMARKS.md block."""
from __future__ import annotations

from osd.bench.record import append_markdown, git_revision, machine, write_result

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
    print(t)
    print(f"result written to {path}")
    if markdown:
        cfg, m = result["config"], machine()
        append_markdown("Serving load (`osd bench serve`)", [
            f"### {cfg['model']} at {cfg['url']}, rev {git_revision()}",
            f"`osd bench serve` machine (client side): {m['cpu']}, {m['cores']} cores;",
            f"{cfg['prompts']} prompts per level, max_tokens={cfg['max_tokens']}, greedy, "
            f"{'chat' if cfg['chat'] else 'completions'} endpoint, streaming; warm-up excluded; JSON: `{path}`",
            "", t,
        ], markdown)
