"""`osd replay --fast` results -> per-segment table (every draft against the control), recovery after shifts
(online and control side by side), forgetting, held-out table with paired z, PNG, BENCHMARKS.md."""
from __future__ import annotations

import math
import sys
from pathlib import Path

from osd_bench.plots import domain_boundaries, moving_average, plot_alpha_curves
from osd.records import emit_report, machine, redacted_command, write_result
from osd_bench.report import table

CONTROL = "original"
LABELS = {"original": "control (never trained)", "online": "online", "offline_10pct": "offline 10% (equal steps)",
          "offline_100pct": "offline 100% (equal steps)", "offline_100pct_epochs": "offline 100% (epochs recipe)",
          "offline_arrival": "offline 100%, arrival order (equal steps)"}


def label(variant: str) -> str:
    return LABELS.get(variant, variant)


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


def recovery(part: list[dict], bound: float, window: int, tolerance: float = 0.05, key: str = "online_alpha") -> int | None:
    """Requests into a segment from which on `key`'s moving average stays within `tolerance` of `bound` to the
    segment's end (None: never, or it fell back out): a noisy curve touching the bound once is not a recovery.
    Applied to the control too: a figure counts as recovery only where the control's stays out (`recovery_verdict`)."""
    curve, first = moving_average([r[key] for r in part], window), min(window, len(part))
    reached = None
    for i, a in enumerate(curve[first - 1:], start=first):
        reached = (reached or i) if a >= bound - tolerance else None
    return reached


def recovery_verdict(online: int | None, control: int | None) -> str:
    """Recovery means closing a gap the control leaves open: the online draft gets within the tolerance and the control
    does not, or only later."""
    if online is None:
        return "online never within reach"
    if control is not None and control <= online:
        return f"no gap to close: the control is within reach after {control} requests too"
    return ("learning closed a gap the control leaves open" if control is None
            else f"online {control - online} request{'s' if control - online != 1 else ''} before the control")


def recovery_bound(result: dict, domain: str, part: list[dict]) -> tuple[float, str]:
    """The level a segment's online draft recovers to: the offline-100% draft on the domain's held-out requests when
    the run measured them (the online draft too is measured on requests it has not trained on), else its in-stream
    alpha, which it reaches on requests it trained on for several epochs (a higher bar than any online draft meets)."""
    held = ((result.get("end_of_stream_alpha_on_heldout") or {}).get(domain) or {}).get("offline_100pct")
    if held is not None:
        return held, "held-out"
    return sum(r["offline_100pct_alpha"] for r in part) / len(part), "in-stream, on requests it trained on"


def segment_z(part: list[dict], variant: str) -> tuple[int, int, float]:
    """(gained, lost, z) of `variant` against the control over a segment's positions (paired per request)."""
    gained = sum(r.get(f"{variant}_gained", 0) for r in part)
    lost = sum(r.get(f"{variant}_lost", 0) for r in part)
    return gained, lost, (gained - lost) / math.sqrt(gained + lost) if gained + lost else 0.0


def summary(result: dict, window: int) -> tuple[list[list], list[str]]:
    """One row per segment and draft (the control first): alpha, last quarter, difference from the control with its
    paired z, and requests until within 0.05 of the segment's offline_100pct alpha (recovery_bound)."""
    variants = [CONTROL] + [v for v in result["variants"] if v != CONTROL]
    mean = lambda part, key: sum(r[key] for r in part) / len(part)
    rows = []
    for domain, part in segments(result["requests"]):
        tail = part[-max(1, len(part) // 4):]
        bound = recovery_bound(result, domain, part)[0] if "offline_100pct" in variants else None
        for v in variants:
            gained, lost, z = segment_z(part, v) if v != CONTROL else (None, None, None)
            reach = _requests(recovery(part, bound, window, key=f"{v}_alpha")) \
                if bound is not None and v != "offline_100pct" else None
            rows.append([domain, len(part), label(v), mean(part, f"{v}_alpha"), mean(tail, f"{v}_alpha"),
                         mean(tail, f"{v}_alpha") - mean(tail, f"{CONTROL}_alpha") if v != CONTROL else None,
                         gained, lost, z, reach])
    header = ["segment", "requests", "draft", "alpha (all)", "alpha (last 25%)", "vs control (last 25%)",
              "gained", "lost", "z vs control", f"requests to within 0.05 of offline 100% (window {window})"]
    return rows, header


def recovery_notes(result: dict, window: int) -> list[str]:
    """Per segment after the first (a shift), the online and the control figures side by side, with the verdict."""
    if "offline_100pct" not in result["variants"]:
        return []
    notes = []
    for n, (domain, part) in enumerate(segments(result["requests"])):
        bound, basis = recovery_bound(result, domain, part)
        online, control = (recovery(part, bound, window, key=f"{v}_alpha") for v in ("online", CONTROL))
        notes.append(f"{'after the switch to ' if n else 'first segment '}{domain}: within 0.05 of offline 100% for good "
                     f"({bound:.3f}, {basis}): online {_after(online)}, the control {_after(control)}: "
                     f"{recovery_verdict(online, control)}")
    return notes


def _after(n: int | None) -> str:
    return "never" if n is None else f"after {n} requests"


def _requests(n: int | None) -> int | str:
    return "never" if n is None else n


def heldout_rows(result: dict) -> list[list]:
    """Per dataset and draft (the control first): held-out alpha, its difference from the control, gained / lost / z."""
    rows = []
    for domain, alphas in (result.get("end_of_stream_alpha_on_heldout") or {}).items():
        paired = (result.get("heldout_vs_control") or {}).get(domain, {})
        for v in [CONTROL] + [v for v in alphas if v != CONTROL]:
            d = paired.get(v, {})
            rows.append([domain, label(v), alphas[v], alphas[v] - alphas[CONTROL] if v != CONTROL else None,
                         d.get("gained"), d.get("lost"), d.get("z")])
    return rows


def forgetting_rows(result: dict) -> list[list]:
    """After each segment, the online draft on every domain's held-out requests next to the control's, paired (z), and
    its change since the end of that domain's own segment (negative: forgotten)."""
    rows, own = [], {}
    for point in result.get("heldout_after_each_segment") or []:
        for d, h in point["heldout"].items():
            if point["last_domain"] == d:
                own.setdefault(d, h["online"])
            rows.append([point["at_request"], point["last_domain"], d, h["control"], h["online"], h["online"] - h["control"],
                         h["gained"], h["lost"], h["z"], h["online"] - own[d] if d in own else None])
    return rows


FORGETTING_HEADER = ["after request", "last domain", "held-out requests of", "control", "online", "vs control", "gained",
                     "lost", "z", "online change since its own segment"]


def plot(result: dict, path: str, window: int) -> str | None:
    """The paper's figure: moving-average alpha vs requests, online, control, offline 10% and 100%."""
    rows, cfg = result["requests"], result["config"]
    order = [v for v in (CONTROL, "offline_10pct", "offline_100pct", "offline_100pct_epochs", "offline_arrival", "online")
             if v in result["variants"]]
    curves = {label(v): [r[f"{v}_alpha"] for r in rows] for v in order}
    boundaries = domain_boundaries(rows) if cfg["overlap"] == 0 else []
    return plot_alpha_curves(curves, boundaries, f"osd replay --fast: {cfg['stream']} (k={cfg['k']})", "greedy alpha",
                             path, window)


def report_fast_replay(result: dict, out: str, markdown: str, window: int = 20) -> None:
    path = write_result(result, out)
    png = plot(result, str(Path(out).with_suffix(".png")), window)
    rows, header = summary(result, window)
    forgetting = result["end_of_stream_alpha_on_segment_probes"]
    f_rows = [[d] + [v.get(name) for name in result["variants"]] for d, v in forgetting.items()]
    f_table = table(f_rows, ["segment probe (its last requests)"] + [label(v) for v in result["variants"]])
    cfg, m = result["config"], machine()
    blocks = ["Mean greedy alpha per segment, every draft on the same requests (the online one measured on each request "
              "before it learns from it); gained / lost / z: positions paired with the control:", table(rows, header),
              *recovery_notes(result, window),
              "At the end of the stream, alpha on each segment's last requests (forgetting):", f_table]
    h_rows = heldout_rows(result)
    if h_rows:
        blocks += [f"At the end of the stream, alpha on {cfg.get('heldout')} held-out requests per dataset (split "
                   f"{cfg.get('heldout_split')}; no draft trained on them), paired with the control on the same positions:",
                   table(h_rows, ["held-out requests of", "draft", "alpha", "vs control", "gained", "lost", "z"])]
    else:
        blocks += ["No held-out requests (--heldout 0): the comparisons above are in-stream only."]
    if len(result.get("heldout_after_each_segment") or []) > 1:
        blocks += ["The online draft on every dataset's held-out requests after each segment (forgetting), against the "
                   "control:", table(forgetting_rows(result), FORGETTING_HEADER)]
    blocks += [_notes(result), f"Exactness: {cfg.get('exactness', '')}"]
    learn = cfg["learn"]
    emit_report("Online replay, greedy fast path (`osd replay --fast`)",
                f"`{redacted_command(sys.argv[1:])}`; draft={cfg.get('models', {}).get('draft')}, k={cfg['k']}, "
                f"loss={learn['loss']}, mode={learn['mode']}, every_requests={learn['every_requests']}, "
                f"steps_per_update={learn['steps_per_update']}, lr={learn['lr']}, trainable={learn['trainable']}, "
                f"train_layers={learn['train_layers']}, guard={learn['guard']} drift_guard={learn.get('drift_guard')}; "
                f"offline baselines: {baselines_note(result)}"
                + (f"; epochs recipe {cfg['baseline_epochs']} epochs lr {cfg['baseline_lr']}" if cfg.get("baseline_epochs") else "")
                + f"; machine: {m['cpu']}, {m['cores']} cores",
                blocks, path, markdown, plot=png)


def baselines_note(result: dict) -> str:
    """What the header says of the offline baselines: only what the run measured."""
    if not result.get("baselines"):
        return "none in this run (--no-baseline)"
    return "the online draft's optimizer steps, same lr / trainable set"


def _notes(result: dict) -> str:
    learner, timings = result["learner"], result["timings"]
    notes = (f"online: {learner['updates_published']} updates published, {learner['updates_rejected']} rejected by the guard, "
             f"{learner.get('rollbacks', 0)} rollbacks and {learner.get('resets', 0)} resets by the drift guard, "
             f"{learner['optimizer_steps']} optimizer steps, {learner['train_seconds']:.0f} s training")
    for name, b in (result.get("baselines") or {}).items():
        notes += f"; {label(name)}: {b['optimizer_steps']} optimizer steps on {b['items']} requests ({b['recipe']})"
    notes += "; " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
    for name in ("offline_100pct", "offline_arrival"):
        for domain, d in (result.get(f"heldout_online_vs_{name}") or {}).items():
            notes += (f"; held-out {domain}, online vs {name} on the same positions: {d['gained']} gained, "
                      f"{d['lost']} lost, z = {d['z']:.2f}")
    return notes
