"""`osd bench soak` results: JSON (with git revision and machine), a console table, a BENCHMARKS.md block."""
from __future__ import annotations

import sys
from pathlib import Path

from osd.records import emit_report, machine, redacted_command, write_result


def kinds_table(result: dict) -> str:
    from osd_bench.report import table

    rows = [[kind, k["expected"], k["sent"], k["ok"], ", ".join(f"{s}: {n}" for s, n in sorted(k["got"].items()))]
            for kind, k in result["kinds"].items()]
    return table(rows, ["request kind", "expected status", "sent", "right", "statuses got"])


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def _pct(value) -> str:
    return "-" if value is None else f"{value:+.2f}%"


def _secs(value) -> str:
    return "-" if value is None else f"{value:.3f} s"


def summary_lines(result: dict) -> str:
    v, i, d, g = result["valid"], result["invalid"], result["disconnects"], result["greedy"]
    s, learner = result["server"], result["learner"]
    lines = [
        f"requests {result['requests']} in {result['wall_seconds']:.0f} s, answered {result['answered']}; "
        f"valid answered in full {v['ok']}/{v['sent']}, invalid rejected with the right status and body "
        f"{i['ok']}/{i['sent']}, mid-stream disconnects {d['ok']}/{d['sent']}",
        f"greedy answers identical to target-only: {g['identical']}/{g['checked']}; "
        f"latency of valid requests p50 {_secs(v['latency_p50'])}, p95 {_secs(v['latency_p95'])}",
        f"server RSS {_mib(s.get('rss_after_serial_warmup_bytes'))} after one request of each kind, "
        f"{_mib(s['rss_start_bytes'])} after {result.get('warmup_rounds', 1)} concurrent warm-up round(s) (learner "
        f"updates published by then: {result['learner']['updates_published_start']}) -> {_mib(s['rss_mid_bytes'])} mid-soak -> "
        f"{_mib(s['rss_end_bytes'])} at the end ({_pct(s['rss_growth_pct'])}; second half "
        f"{_pct(s['rss_growth_second_half_pct'])}; from one request of each kind "
        f"{_pct(s.get('rss_growth_from_serial_warmup_pct'))}), median of the first / second half "
        f"{_mib(s.get('rss_median_first_half_bytes'))} / {_mib(s.get('rss_median_second_half_bytes'))} "
        f"({_pct(s.get('rss_median_growth_pct'))}), peak {_mib(s['rss_peak_bytes'])}; threads {s['threads_start']} -> "
        f"{s['threads_end']}",
        f"learner during the soak: updates published {learner['updates_published']}, rejected "
        f"{learner['updates_rejected']}, optimizer steps {learner['optimizer_steps']} (version {learner['version_start']} "
        f"-> {learner['version_end']}); every response counted in osd_http_requests_total: "
        f"{result['metrics_match_responses']}",
    ]
    if learner.get("memory_buffers_bytes_end") is not None:
        held = lambda when: ", ".join(f"{part} {_mib(learner.get(f'memory_{part}_bytes_{when}'))}"
                                      for part in ("optimizer", "versions", "buffers"))
        lines.append(f"learner memory (osd_learner_memory_*_bytes): after warm-up {held('start')}; at the end {held('end')}")
    if result.get("shutdown"):
        sd = result["shutdown"]
        lines.append(f"SIGTERM shutdown: {'graceful' if sd['graceful'] else 'NOT graceful'} (exit code "
                     f"{sd['returncode']}) after {sd['seconds']:.1f} s")
    lines.append("targets: " + ", ".join(f"{name} {'-' if ok is None else 'yes' if ok else 'NO'}"
                                         for name, ok in result["targets"].items()))
    return "\n".join(lines)


def plot_rss(result: dict, path: str) -> str | None:
    """The server's RSS over the soak, with the median of each half (a leak shows as a rising level)."""
    from osd_bench.plots import plot_series

    s, cfg = result["server"], result["config"]
    marks = {f"median, {h} half": s[f"rss_median_{h}_half_bytes"] / 2**20 for h in ("first", "second")
             if s.get(f"rss_median_{h}_half_bytes")}
    return plot_series(s["rss_series_mib"]["mib"], s["rss_series_mib"]["every_seconds"],
                       f"osd serve RSS under osd bench soak ({cfg.get('models', '?')} pair, {cfg['clients']} clients)",
                       "RSS (MiB)", path, marks)


def report_soak(result: dict, out: str, markdown: str) -> None:
    path = write_result(result, out)
    png = plot_rss(result, str(Path(out).with_suffix(".png"))) if result["server"].get("rss_series_mib") else None
    cfg, m = result["config"], machine()
    emit_report("Soak (`osd bench soak`)",
                f"`{redacted_command(sys.argv[1:])}`: {cfg['clients']} concurrent clients for {cfg['seconds']:.0f} s "
                f"(pause between requests {cfg.get('pause', 0)} s) "
                f"against `osd serve` on the {cfg.get('models', '?')} pair ({cfg.get('target', '?')} / "
                f"{cfg.get('draft', '?')}), {cfg['cases']} request cases, max_tokens={cfg.get('max_tokens')}; "
                f"machine: {m['cpu']}, {m['cores']} cores" + (f"; RSS plot: `{png}`" if png else ""),
                [kinds_table(result), summary_lines(result)], path, markdown)
