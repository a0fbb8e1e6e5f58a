"""`osd bench evidence`: issue 17's held-out table across finished fast replays, with each target's verdict.

Reads the JSON that `osd replay --fast` wrote (nothing is re-measured): per stream and held-out dataset, the
never-trained control, the online draft and the offline drafts given the online draft's optimizer steps, each paired
with the control on the same positions (gained / lost / z), and the online draft against the offline draft that saw
the whole stream. Where the replay ran `--baseline-arrival`, also the online draft against the equal-step offline draft
held to the requests that had arrived by each step (what the online setting itself allows). The verdicts apply the
issue's targets as stated; a grouped bar chart shows the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GAIN_OVER_CONTROL = 0.10  # online >= control + 0.10 (on at least three of five single-domain streams)
GAP_TO_OFFLINE = -0.01  # online >= offline-100% (equal steps) - 0.01
NEVER_WORSE_Z = -1.64  # online vs control: never significantly below it
ARMS = ("original", "offline_10pct", "offline_100pct", "offline_arrival", "online")


@dataclass(frozen=True)
class Evidence:
    """One held-out dataset of one replay."""
    run: str
    stream: str
    draft: str
    requests: int
    dataset: str
    alpha: dict[str, float | None]  # by arm (ARMS); None: the arm was not run
    z_vs_control: dict[str, float | None]
    online_vs_offline_z: float | None
    steps: dict[str, int | None]  # optimizer steps: online, offline_100pct
    online_vs_arrival_z: float | None = None  # None: the replay ran no --baseline-arrival

    @property
    def gain(self) -> float:
        return self.alpha["online"] - self.alpha["original"]

    @property
    def gap(self) -> float | None:
        return self._online_minus("offline_100pct")

    @property
    def gap_to_arrival(self) -> float | None:
        return self._online_minus("offline_arrival")

    def _online_minus(self, arm: str) -> float | None:
        """Online alpha minus an offline arm's; None where the replay did not train that arm."""
        other = self.alpha.get(arm)
        return None if other is None else self.alpha["online"] - other


def evidence_of(result: dict, run: str) -> list[Evidence]:
    """Every held-out dataset of one fast-replay result (empty when it measured none)."""
    heldout = result.get("end_of_stream_alpha_on_heldout") or {}
    paired, versus = result.get("heldout_vs_control") or {}, result.get("heldout_online_vs_offline_100pct") or {}
    versus_arrival = result.get("heldout_online_vs_offline_arrival") or {}
    baselines = result.get("baselines") or {}
    config = result.get("config", {})
    steps = {"online": result.get("learner", {}).get("optimizer_steps"),
             "offline_100pct": (baselines.get("offline_100pct") or {}).get("optimizer_steps")}
    out = []
    for dataset, alpha in heldout.items():
        z = {arm: (paired.get(dataset, {}).get(arm) or {}).get("z") for arm in ARMS if arm != "original"}
        out.append(Evidence(run=run, stream=str(config.get("stream", "?")),
                            draft=str(config.get("models", {}).get("draft", "?")), requests=len(result.get("requests", [])),
                            dataset=dataset, alpha={arm: alpha.get(arm) for arm in ARMS}, z_vs_control=z,
                            online_vs_offline_z=(versus.get(dataset) or {}).get("z"), steps=steps,
                            online_vs_arrival_z=(versus_arrival.get(dataset) or {}).get("z")))
    return out


def verdicts(rows: list[Evidence]) -> dict:
    """The issue's targets over single-domain streams (one held-out dataset each): how many reach control + 0.10, which
    are within 0.01 of the equal-step offline draft, how many are not significantly below the arrival-order offline
    draft, and whether any is significantly below the control."""
    single = [r for r in rows if "," not in r.stream]
    with_offline = [r for r in single if r.gap is not None]
    with_arrival = [r for r in single if r.gap_to_arrival is not None]
    return {"streams": len(single),
            "gain_met": sum(r.gain >= GAIN_OVER_CONTROL for r in single),
            "gap_met": sum(r.gap >= GAP_TO_OFFLINE for r in with_offline), "gap_measured": len(with_offline),
            "arrival_not_below": sum((r.online_vs_arrival_z or 0.0) > NEVER_WORSE_Z for r in with_arrival),
            "arrival_measured": len(with_arrival),
            "worse_than_control": [f"{r.run}:{r.dataset}" for r in rows
                                   if (r.z_vs_control["online"] or 0.0) <= NEVER_WORSE_Z]}


def evidence_table(rows: list[Evidence]) -> str:
    from osd_bench.report import table

    header = ["run", "draft", "requests", "held-out", "control", "online", "online - control (z)", "offline 10%",
              "offline 100%", "online - offline 100% (z)", "offline arrival", "online - offline arrival (z)",
              "steps online / offline"]
    fmt = lambda v, z: "-" if v is None else f"{v:+.3f}" + ("" if z is None else f" ({z:.1f})")
    body = [[r.run, r.draft.replace("derived:", ""), r.requests, r.dataset, r.alpha["original"], r.alpha["online"],
             fmt(r.gain, r.z_vs_control["online"]), r.alpha["offline_10pct"], r.alpha["offline_100pct"],
             fmt(r.gap, r.online_vs_offline_z), r.alpha.get("offline_arrival"),
             fmt(r.gap_to_arrival, r.online_vs_arrival_z), f"{r.steps['online']} / {r.steps['offline_100pct'] or '-'}"]
            for r in rows]
    return table(body, header)


def plot_evidence(rows: list[Evidence], path: str) -> str | None:
    """Grouped bars per (run, held-out dataset): control, online, offline 100% (equal steps), and offline in arrival
    order where any run measured it."""
    from osd_bench.plots import plot_grouped_bars

    groups = [f"{r.dataset}\n{r.requests} req" + ("\n(shift)" if "," in r.stream else "") for r in rows]
    series = {label: [r.alpha[arm] for r in rows] for arm, label in (
        ("original", "control (never trained)"), ("online", "online"), ("offline_100pct", "offline 100% (equal steps)"),
        ("offline_arrival", "offline, arrival order (equal steps)")) if any(r.alpha.get(arm) is not None for r in rows)}
    return plot_grouped_bars(groups, series, "End of stream, requests no draft trained on",
                             "held-out greedy acceptance", path)


def report_evidence(paths: list[str], out: str, markdown: str | None) -> dict:
    from osd.records import emit_report, read_result, write_result
    from osd.errors import InvalidArgument

    rows: list[Evidence] = []
    for p in paths:
        rows += evidence_of(read_result(p), Path(p).stem)
    if not rows:
        raise InvalidArgument("none of these results measured held-out requests (osd replay --fast --heldout N)")
    summary = verdicts(rows)
    result = {"sources": paths, "rows": [{**vars(r), "gain": r.gain, "gap": r.gap} for r in rows],
              "verdicts": summary, "targets": {"gain_over_control": GAIN_OVER_CONTROL, "gap_to_offline": GAP_TO_OFFLINE,
                                               "never_worse_z": NEVER_WORSE_Z}}
    path = write_result(result, out)
    plot = plot_evidence(rows, str(path.with_suffix(".png")))
    caption = (f"single-domain streams reaching control + {GAIN_OVER_CONTROL:.2f}: {summary['gain_met']} of "
               f"{summary['streams']}; within {-GAP_TO_OFFLINE:.2f} of the equal-step offline-100% draft: "
               f"{summary['gap_met']} of {summary['gap_measured']}; not significantly below the arrival-order "
               f"offline draft (z > {NEVER_WORSE_Z}): {summary['arrival_not_below']} of {summary['arrival_measured']}; "
               f"significantly below the control (z <= "
               f"{NEVER_WORSE_Z}): {', '.join(summary['worse_than_control']) or 'none'}")
    emit_report("Learning evidence across streams (`osd bench evidence`)",
                f"`osd bench evidence {' '.join(paths)}`; numbers read from those JSON files (each names its command, "
                "machine and revision)", [evidence_table(rows), caption], path, markdown, plot)
    return result
