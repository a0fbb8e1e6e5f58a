"""`osd replay --fast` results -> per-segment table, recovery after shifts, forgetting, PNG, BENCHMARKS.md."""
from __future__ import annotations

import sys
from pathlib import Path

from osd.bench.record import emit_report, machine, redacted_command, write_result
from osd.bench.plots import domain_boundaries, moving_average, plot_alpha_curves
from osd.bench.report import table


def segments(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """Consecutive runs of one domain (a drifting stream gives many short runs: grouped by domain then)."""
    out = []
    for r in rows:
        if out and out[-1][0] == r["domain"]:
            out[-1][1].append(r)
        else:
            out.append((r["domain"], [r]))
    if len(out) > len({d for d, _ in out}):  # drift: one group per domain
        out = [(d, [r for r in rows if r["domain"] == d]) for d in dict.fromkeys(r["domain"] for r in rows)]
    return out


def recovery(part: list[dict], bound: float, window: int, tolerance: float = 0.05) -> int | None:
    """Requests into a segment until online alpha (moving average) is within `tolerance` of `bound`."""
    curve = moving_average([r["online_alpha"] for r in part], window)
    return next((i + 1 for i, a in enumerate(curve) if i + 1 >= min(window, len(part)) and a >= bound - tolerance), None)


def summary(result: dict, window: int) -> tuple[list[list], list[str]]:
    variants = result["variants"]
    mean = lambda part, key: sum(r[key] for r in part) / len(part)
    rows = []
    for domain, part in segments(result["requests"]):
        tail = part[-max(1, len(part) // 4):]
        bound = mean(part, "offline_100pct_alpha") if "offline_100pct" in variants else None
        rows.append([domain, len(part)] + [mean(part, f"{v}_alpha") for v in variants]
                    + [mean(tail, f"{v}_alpha") for v in variants]
                    + [recovery(part, bound, window) if bound is not None else None])
    header = (["segment", "requests"] + [f"{v} (all)" for v in variants] + [f"{v} (last 25%)" for v in variants]
              + [f"requests to within 0.05 of offline_100pct (window {window})"])
    return rows, header


def plot(result: dict, path: str, window: int) -> str | None:
    rows, cfg = result["requests"], result["config"]
    curves = {v.replace("_", " "): [r[f"{v}_alpha"] for r in rows] for v in result["variants"]}
    boundaries = domain_boundaries(rows) if cfg["overlap"] == 0 else []
    return plot_alpha_curves(curves, boundaries, f"osd replay --fast: {cfg['stream']} (k={cfg['k']})", "greedy alpha",
                             path, window)


def report_fast_replay(result: dict, out: str, markdown: str, window: int = 20) -> None:
    path = write_result(result, out)
    png = plot(result, str(Path(out).with_suffix(".png")), window)
    rows, header = summary(result, window)
    t = table(rows, header)
    forgetting = result["end_of_stream_alpha_on_segment_probes"]
    f_rows = [[d] + [v.get(name) for name in result["variants"]] for d, v in forgetting.items()]
    f_table = table(f_rows, ["segment probe (its last requests)"] + result["variants"])
    heldout = result.get("end_of_stream_alpha_on_heldout") or {}
    h_table = table([[d] + [v.get(name) for name in result["variants"]] for d, v in heldout.items()],
                    ["held-out requests of"] + result["variants"]) if heldout else ""
    learner, timings = result["learner"], result["timings"]
    notes = (f"online: {learner['updates_published']} updates published, {learner['updates_rejected']} rejected by the guard, "
             f"{learner['optimizer_steps']} optimizer steps, {learner['train_seconds']:.0f} s training; "
             + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    for domain, d in (result.get("heldout_online_vs_offline_100pct") or {}).items():
        notes += (f"; held-out {domain}, online vs offline_100pct on the same positions: {d['gained']} gained, "
                  f"{d['lost']} lost, z = {d['z']:.2f}")
    cfg, m = result["config"], machine()
    learn = cfg["learn"]
    blocks = ["Mean greedy alpha per segment (each draft measured on a request before the online one learns from it):", t,
              "At the end of the stream, alpha on each segment's last requests (forgetting):", f_table]
    if h_table:
        blocks += [f"At the end of the stream, alpha on {cfg.get('heldout')} held-out requests per dataset (split "
                   f"{cfg.get('heldout_split')}; no draft trained on them):", h_table]
    emit_report("Online replay, greedy fast path (`osd replay --fast`)",
                f"`{redacted_command(sys.argv[1:])}`; k={cfg['k']}, loss={learn['loss']}, mode={learn['mode']}, "
                f"every_requests={learn['every_requests']}, steps_per_update={learn['steps_per_update']}, lr={learn['lr']}, "
                f"trainable={learn['trainable']}, train_layers={learn['train_layers']}; baselines {cfg['baseline_epochs']} "
                f"epochs lr {cfg['baseline_lr']}; machine: {m['cpu']}, {m['cores']} cores",
                blocks + [notes], path, markdown, plot=png)
