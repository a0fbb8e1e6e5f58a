"""`osd bench live`'s report: the JSON, a per-window table per load, the headline and targets, a plot of both curves."""
from __future__ import annotations

from pathlib import Path

from osd.records import emit_report, table, write_result

SECTION = "Live learning: learning on vs off under Poisson load (osd bench live)"
COLUMNS = ["decode_tps_mean", "ttft_p50", "aggregate_tps", "acceptance", "tokens_per_step", "mean_k", "draft_version",
           "optimizer_steps", "learner_cpu_share", "learner_busy_share", "rows_per_pass", "prompt_rows_per_pass",
           "pass_ms", "draft_share"]


def window_table(entry: dict) -> str:
    arms, cmp = entry["arms"], entry.get("comparison") or {"windows": []}
    ratios = {w["first"]: w["decode_tps_ratio"] for w in cmp["windows"]}
    rows = []
    for arm in ("off", "on"):
        for w in arms.get(arm, {}).get("windows", []):
            rows.append([arm, f"{w['first']}-{w['first'] + w['requests'] - 1}", *[w.get(c) for c in COLUMNS],
                         ratios.get(w["first"]) if arm == "on" else None])
    header = ["learning", "requests", "decode tok/s", "TTFT p50 s", "agg tok/s", "acceptance", "tok/step", "k",
              "version", "opt steps", "learner CPU", "learner busy share", "rows/pass", "prompt rows/pass", "pass ms",
              "draft share", "on/off"]
    return table(rows, header)


def headline(entry: dict) -> str:
    c = entry.get("comparison")
    on = entry["arms"].get("on") or {}
    pub = on.get("first_publish") or {}
    fmt = lambda v: "-" if v is None else f"{v:.3f}"
    span = lambda c, key: f" [{c[key][0]:.2f}, {c[key][1]:.2f}]" if c.get(key) else ""  # noqa: E731
    text = (f"load {entry['load']} ({entry['rate_per_s']:.3f} requests/s): first publish after "
            f"{pub.get('requests_arrived', '-')} requests ({fmt(pub.get('seconds'))} s)")
    if c:
        text += (f"; decode tok/s learning on / off: first quarter {fmt(c['first_quarter_ratio'])}, last quarter "
                 f"{fmt(c['last_quarter_ratio'])}, lowest window after the first "
                 f"{fmt(c['min_ratio_after_first_window'])}; whole run: mean {fmt(c.get('mean_ratio'))}"
                 f"{span(c, 'mean_ratio_interval')}, paired per-request p50 {fmt(c['paired_ratio_p50'])}"
                 f"{span(c, 'paired_ratio_p50_interval')} (95% block-bootstrap intervals); greedy answers identical "
                 f"{c['greedy_identical']['same']}/{c['greedy_identical']['of']}")
    return text


def plot_live(result: dict, path: str) -> str | None:
    from osd_bench.plots import _pyplot, _save

    plt = _pyplot()
    if plt is None:
        return None
    loads = result["loads"]
    fig, axes = plt.subplots(len(loads), 2, figsize=(11, 3.4 * len(loads)), squeeze=False)
    for row, entry in zip(axes, loads):
        for arm, style in (("off", "--"), ("on", "-")):
            ws = entry["arms"].get(arm, {}).get("windows", [])
            row[0].plot([w["first"] + w["requests"] / 2 for w in ws], [w["decode_tps_mean"] for w in ws], style,
                        marker="o", label=f"learning {arm}")
        row[0].set(xlabel="request (window centre)", ylabel="decode tokens/s per request",
                   title=f"load {entry['load']} of capacity")
        row[0].legend()
        ws = (entry.get("comparison") or {}).get("windows", [])
        row[1].plot([w["first"] for w in ws], [w["decode_tps_ratio"] for w in ws], marker="o")
        row[1].axhline(1.0, color="grey", linewidth=0.8)
        row[1].set(xlabel="request (window start)", ylabel="learning on / off", title="decode tokens/s ratio")
    return _save(plt, fig, path, 110)


def report_live(result: dict, out: str, markdown: str | None) -> None:
    path = write_result(result, out)
    plot = plot_live(result, str(Path(out).with_suffix(".png")))
    blocks = []
    for entry in result["loads"]:
        blocks += [headline(entry), window_table(entry)]
        blocks += [f"{arm}: {a['calibration']}" for arm, a in entry["arms"].items() if a.get("calibration")]
    cfg = result["config"]
    description = (f"`{result.get('command', 'osd bench live')}`: stream {cfg['stream']} ({cfg['split']}), "
                   f"{cfg['requests']} requests, capacity {result['capacity']['requests_per_s']:.3f} requests/s, "
                   f"max_tokens {cfg['max_tokens']}, target {cfg['target']}, draft {cfg['draft']}")
    emit_report(SECTION, description, blocks, path, markdown, plot)
