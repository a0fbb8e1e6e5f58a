"""`osd bench serve` results: JSON (with git revision and machine), a console table, a BENCHMARKS.md block."""
from __future__ import annotations

import sys

from osd.records import emit_report, machine, redacted_command, write_result
from osd_bench.serve_load import optimizer_steps

COLUMNS = [("concurrency", "concurrency"), ("requests", "requests"), ("errors", "errors"),
           ("tokens_per_second", "tokens/s"), ("requests_per_second", "req/s"), ("ttft_p50", "TTFT p50 s"),
           ("ttft_p95", "TTFT p95 s"), ("tpot_p50", "TPOT p50 s"), ("tpot_p95", "TPOT p95 s"),
           ("acceptance_rate", "acceptance"), ("tokens_per_step", "tokens/step")]


def load_table(result: dict) -> str:
    from osd_bench.report import table

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
    from osd_bench.report import table

    rows = []
    for r in result["rounds"]:
        on, off = r["learning"], r["paused"]
        ratio = lambda key: on[key] / off[key] if on.get(key) and off.get(key) else None
        rows.append([r["round"], "learning first" if r["round"] % 2 == 0 else "paused first", on["tpot_p50"],
                     off["tpot_p50"], ratio("tpot_p50"), on["tokens_per_second"], off["tokens_per_second"],
                     ratio("tokens_per_second"), optimizer_steps(on), on["acceptance_rate"], off["acceptance_rate"],
                     on["errors"] + off["errors"]])
    return table(rows, ["round", "order", "TPOT p50 learning s", "TPOT p50 paused s", "ratio", "tok/s learning",
                        "tok/s paused", "ratio", "optimizer steps", "acceptance learning", "acceptance paused", "errors"])


def _throughput(ratio: dict | None) -> str:
    if not ratio or ratio.get("ratio") is None:
        return "-"
    ci = ratio["ci95"]
    return (f"{_fmt(ratio['ratio'])} (95% interval {_fmt(ci[0]) if ci else '-'} .. {_fmt(ci[1]) if ci else '-'}; "
            f"learning faster in {ratio['on_slower_rounds']} of {ratio['rounds']} rounds)")


def report_paired(result: dict, out: str, markdown: str) -> None:
    path = write_result(result, out)
    cfg, m, ratio = result["config"], machine(), result["tpot_p50_ratio"]
    ci = ratio["ci95"]
    summary = (f"Learning vs paused, p50 TPOT ratio over {ratio['rounds']} round pairs: {_fmt(ratio['ratio'])} "
               f"(95% interval {_fmt(ci[0]) if ci else '-'} .. {_fmt(ci[1]) if ci else '-'}; learning slower in "
               f"{ratio['on_slower_rounds']} of {ratio['rounds']} rounds); aggregate tokens/s ratio "
               f"{_throughput(result.get('tokens_per_second_ratio'))}; optimizer steps while learning "
               f"{result['optimizer_steps_learning']}, while paused {result['optimizer_steps_paused']}; "
               f"{result['pause_wait_seconds']:.1f} s of learning work finished inside pause requests (counted in no round) "
               f"against {result['learning_wall_seconds']:.1f} s of learning rounds")
    emit_report("Serving load (`osd bench serve`)",
                f"`{redacted_command(sys.argv[1:])}` against {cfg['model']} at {cfg['url']}: one learning server, "
                f"{cfg['rounds']} round pairs of {cfg['prompts']} prompts, learner running vs paused, alternating order, "
                f"concurrency {cfg['concurrency']}, max_tokens={cfg['max_tokens']}, greedy, "
                f"{'chat' if cfg['chat'] else 'completions'} endpoint, streaming, warm-up excluded; machine: {m['cpu']}, "
                f"{m['cores']} cores", [paired_table(result), summary], path, markdown)


# --- `osd bench serve-vs`: osd serve against llama-server ---------------------------------------------------------
VS_COLUMNS = [("server", "server"), ("concurrency", "c"), ("aggregate_tokens_per_s", "aggregate tok/s"),
              ("vs_llama", "x llama-server"), ("vs_llama_native", "x llama-server native"),
              ("decode_tokens_per_s_p50", "decode tok/s p50"), ("ttft_p50_s", "TTFT p50 s"), ("ttft_p95_s", "TTFT p95 s"),
              ("e2e_p50_s", "e2e p50 s"), ("e2e_p95_s", "e2e p95 s"), ("errors", "errors"), ("peak_rss_gb", "peak RSS GB"),
              ("mean_k", "mean k"), ("acceptance_rate", "acceptance"), ("rows_per_step", "rows/step")]
ANCHORS = {"vs_llama": "llama-server", "vs_llama_native": "llama-server-native"}  # ratio column -> the llama arm


def vs_rows(records: list[dict]) -> list[dict]:
    """Each record with its ratios to each llama-server build's aggregate tokens/s at the same level (None where that
    build did not run), and peak RSS in GB (1e9)."""
    anchors = {column: {r["concurrency"]: r["aggregate_tokens_per_s"] for r in records if r["server"] == server}
               for column, server in ANCHORS.items()}
    out = []
    for r in records:
        ratios = {}
        for column, anchor in anchors.items():
            base = anchor.get(r["concurrency"])
            ratios[column] = r["aggregate_tokens_per_s"] / base if base and r["aggregate_tokens_per_s"] else None
        out.append(dict(r, **ratios, peak_rss_gb=r["peak_rss_bytes"] / 1e9 if r.get("peak_rss_bytes") else None))
    return sorted(out, key=lambda r: (r["concurrency"], r["server"]))


def vs_table(result: dict) -> str:
    """The table, without the ratio column of a llama-server build that did not run."""
    from osd_bench.report import table

    rows = vs_rows(result["records"])
    columns = [(key, title) for key, title in VS_COLUMNS
               if key not in ANCHORS or any(r[key] is not None for r in rows)]
    return table([[r.get(key) for key, _ in columns] for r in rows], [title for _, title in columns])


def prefill_lines(result: dict) -> list[str]:
    """One line per server: prompt tokens/s on the long prompt, and its ratio to each llama-server build's."""
    rows = {r["server"]: r for r in result.get("prefill", []) if r.get("prompt_tokens_per_s")}
    lines = []
    for name, r in rows.items():
        ratios = [f"{r['prompt_tokens_per_s'] / rows[server]['prompt_tokens_per_s']:.2f}x {server}"
                  for server in ANCHORS.values() if server in rows and server != name]
        lines.append(f"- prefill, {r['prompt_tokens']}-token prompt alone: `{name}` {r['prompt_tokens_per_s']:.0f} prompt "
                     f"tokens/s ({r['ttft_s']:.2f} s to the first token)" + "".join(f", {x}" for x in ratios))
    return lines


def build_lines(result: dict) -> list[str]:
    """Which CPU features each llama-server build's ggml was compiled for, one line per build."""
    builds = {r["server"]: (r["llama_build"], r["llama_features"]) for r in result["records"] if r.get("llama_features")}
    return [f"- `{server}` ({build} build): {info}" for server, (build, info) in builds.items()]


def failed_lines(result: dict) -> list[str]:
    """The arms whose server did not start (the run went on without them), with the end of each one's log."""
    return [f"- `{f['server']}` did not run: {f['error']}; last log line: {(f.get('log_tail') or ['-'])[-1]!r}"
            for f in result.get("failed_arms", [])]


def identity_lines(result: dict) -> list[str]:
    lines = []
    for arm, by_level in result.get("identity", {}).items():
        cells = ", ".join(f"c={c}: {v['same']}/{v['of']}" for c, v in by_level.items())
        lines.append(f"- greedy answers of `{arm}` equal to osd target-only's on the same prompt: {cells}")
    return lines


def plot_vs(result: dict, path: str) -> str | None:
    from osd_bench.plots import _pyplot, _save

    plt = _pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for server in dict.fromkeys(r["server"] for r in result["records"]):
        rows = [r for r in result["records"] if r["server"] == server]
        levels = [r["concurrency"] for r in rows]
        left.plot(levels, [r["aggregate_tokens_per_s"] for r in rows], marker="o", label=server)
        right.plot(levels, [r["ttft_p95_s"] for r in rows], marker="o", label=server)
    for ax, ylabel in ((left, "aggregate output tokens/s"), (right, "TTFT p95 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    left.legend()
    fig.suptitle("osd serve vs llama-server, same GGUF, same prompts")
    return _save(plt, fig, path, 120)


def report_vs(result: dict, out: str, markdown: str) -> None:
    path = write_result(result, out)
    plot = plot_vs(result, str(path.with_suffix(".png")))
    cfg, m = result["config"], machine()
    emit_report("Serving under load: osd serve vs llama-server (`osd bench serve-vs`)",
                f"`{redacted_command(sys.argv[1:])}` on {m['cpu']} ({m['cores']} cores; flags {m['cpu_flags']}); "
                f"{cfg['per_level']} streaming greedy chat requests per level, {cfg['max_tokens']} tokens, "
                f"{cfg['threads']} threads, each server alone",
                [vs_table(result), "\n".join(failed_lines(result) + identity_lines(result) + prefill_lines(result)
                                              + build_lines(result))],
                path, markdown, plot)
