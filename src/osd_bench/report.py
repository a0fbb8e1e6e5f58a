"""Turning benchmark results into JSON files, console tables and, when asked (--markdown), markdown blocks."""
from __future__ import annotations

import sys
from pathlib import Path

from osd_bench.plots import domain_boundaries, plot_alpha_curves
from osd.records import emit_report, machine, redacted_command, table, write_result  # noqa: F401 - table: re-exported


def report_speed(result: dict, out: str, markdown: str) -> None:
    from osd_bench.speed import COPY_ARMS, decode_speedup_by_domain, work_by_domain

    path = write_result(result, out)
    decode, e2e = result["decode_tokens_per_second"], result["end_to_end_tokens_per_second"]
    base, diffs = result["baseline"], result["outputs_differing_from_osd_target"]
    rows = [[name, decode[name], decode[name] / decode[base], e2e[name], e2e[name] / e2e[base], diffs[name]]
            for name in decode]
    t = table(rows, ["arm", "decode tok/s", f"x {base}", "end-to-end tok/s", f"x {base} (e2e)",
                     "outputs != reference"])
    s, cal = result["osd_spec_stats"], result["calibration"]
    rss = ", ".join(f"{k} {v:.2f}" for k, v in result["peak_rss_gib"].items())
    f3 = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731 - an arm left out by --arms has no stats
    notes = (f"osd: alpha {f3(s['alpha'])}, tokens/step {f3(s['tokens_per_step'])}, acceptance {f3(s['acceptance_rate'])}, "
             f"proposed {s.get('proposed', '-')}; measured c = {cal['c']:.3f}, verify cost (k+1 tokens / 1) = "
             + ", ".join(f"{v:.2f}" for v in cal["verify_cost"])
             + f"; target backend {result['target_backend']} (max rows per verify {result['target_max_rows']}); "
             f"peak RSS GiB: {rss}; reference of osd_q4: osd_q4_target, of the other arms: osd_target")
    if result.get("osd_q4_spec_stats"):
        q, qc = result["osd_q4_spec_stats"], result["osd_q4_calibration"]
        notes += (f"\nosd_q4 (own Q4_K kernel): alpha {q['alpha']:.3f}, tokens/step {q['tokens_per_step']:.2f}, "
                  f"measured c = {qc['c']:.3f}, verify cost = " + ", ".join(f"{v:.2f}" for v in qc["verify_cost"]))
        if result["config"].get("busy_calibration"):
            after = result["osd_q4_target_seconds_after_run"]  # written beside osd_q4_calibration (bench/speed.py)
            notes += (f"; calibrated beside {result['config']['busy_calibration']} spinning processes (none while "
                      f"decoding): one-row target {qc['t_target'][0]:.3f} s calibrated, {after[0]:.3f} s estimated "
                      f"after the run")
    if result.get("osd_q4_learned"):
        learned = result["osd_q4_learned"]
        q, qc = learned["spec_stats"], learned["calibration"]
        notes += (f"\nosd_q4_learned (draft version {learned['draft_version']} from {result['config']['learned_draft']}): "
                  f"alpha {q['alpha']:.3f}, tokens/step {q['tokens_per_step']:.2f}, measured c = {qc['c']:.3f}")
    for arm, copy in COPY_ARMS.items():
        if result.get(arm):
            q, qc = result[arm]["spec_stats"], result[arm]["calibration"]
            notes += (f"\n{arm} (the draft's {copy} serving copy): alpha {q['alpha']:.3f}, tokens/step "
                      f"{q['tokens_per_step']:.2f}, measured c = {qc['c']:.3f}")
    for name, tree in (result.get("trees") or {}).items():
        q, hits = tree["spec_stats"], (tree["recycled"] or {}).get("hit_rate_by_rank", [])
        notes += (f"\n{name} (trees of <= {tree['tree_nodes']} nodes): tokens/step {q['tokens_per_step']:.2f}, rows/step "
                  f"{q['rows_per_step']:.2f}, tree steps {q['tree_steps']} of {q['steps']}, tokens from recycled branches "
                  f"{q['tree_tokens']}; recycled table hit rate by rank " + ", ".join(f"{h:.2f}" for h in hits)
                  + "; the draft's runners-up where its best missed, hit rate by rank "
                  + ", ".join(f"{h:.2f}" for h in (tree.get("draft_runners_up") or {}).get("hit_rate_by_rank", []))
                  + "; shapes (nodes per depth: steps) " + ", ".join(f"{tuple(s)}: {n}" for s, n in tree["top_shapes"][:5]))
    by_domain = decode_speedup_by_domain(result)
    arms = list(decode)
    domains = table([[domain] + [by_domain[domain].get(arm) for arm in arms] for domain in by_domain],
                    ["decode x " + base + " by domain"] + arms)
    work = work_by_domain(result)
    if work:
        osd_arms = sorted({arm for d in work.values() for arm in d})
        work_table = table([[domain] + [f"{w[a]['tokens_per_step']:.2f} / {w[a]['rows_per_step']:.2f} / "
                                        f"{w[a]['recycled_per_step']:.2f}" if a in w else None for a in osd_arms]
                            for domain, w in work.items()],
                           ["tokens per step / rows per step / recycled tokens per step"] + osd_arms)
        domains = domains + "\n\n" + work_table
    cfg, m = result["config"], machine()
    emit_report("Speed (`osd bench speed`)",
                f"`{redacted_command(sys.argv[1:])}` per_domain={cfg['per_domain']} max_new_tokens={cfg['max_new_tokens']} "
                f"k={cfg['spec']['k']} adaptive={cfg['spec']['adaptive']} lookup={cfg['spec'].get('lookup')} "
                f"draft={cfg['models']['draft']!r} llama_cpp_spec_k={cfg['llama_cpp_spec_k']} "
                f"domains={','.join(cfg.get('domains') or [])} offset={cfg.get('offset', 0)}; "
                f"machine: {m['cpu']} ({m.get('cpu_flags')}), {m['cores']} cores, threads {cfg['models']['threads'] or 'default'}",
                [t, domains, notes], path, markdown)


def report_replay(result: dict, out: str, markdown: str, window: int = 10) -> None:
    """The live replay's table by quarter of the stream. With --compare-every N the other arms decode every Nth
    request only: their columns, and the online column they are divided by, are over those requests."""
    path = write_result(result, out)
    png = plot_replay(result, str(Path(out).with_suffix(".png")), window)
    speed_png = plot_live_speed(result, str(Path(out).with_suffix(".speed.png")), max(2, window // 2))
    rows = result["requests"]
    q = max(1, len(rows) // 4)
    mean = lambda key, part: mean_present(r.get(key) for r in part)
    compared = [r for r in rows if "static_tokens_per_second" in r]
    has_static = bool(compared)
    has_plain = any("target_only_tokens_per_second" in r for r in rows)
    has_llama = any("llama_cpp_target_tokens_per_second" in r for r in rows)
    sampled = len(compared) < len(rows)  # --compare-every > 1
    table_rows, quarters = [], {}
    for name, part in (("first quarter", rows[:q]), ("last quarter", rows[-q:]), ("all", rows)):
        same = [r for r in part if "static_tokens_per_second" in r]
        figures = {"online": mean("tokens_per_second", part), "online_compared": mean("tokens_per_second", same),
                   "static": mean("static_tokens_per_second", same) if has_static else None,
                   "plain": mean("target_only_tokens_per_second", same) if has_plain else None,
                   "llama": mean("llama_cpp_target_tokens_per_second", same) if has_llama else None}
        quarters[name] = figures
        table_rows.append([name, mean("alpha", part), mean("static_alpha", part) if has_static else None,
                           mean("tokens_per_step", part), figures["online"]]
                          + ([figures["online_compared"], len(same)] if sampled else [])
                          + [figures["static"], figures["plain"], figures["llama"]])
    header = (["requests", "alpha online", "alpha static", "tokens/step online", "tok/s online"]
              + (["tok/s online (compared requests)", "compared requests"] if sampled else [])
              + ["tok/s static", "tok/s osd target-only", "tok/s llama.cpp target-only"])
    t = table(table_rows, header)
    intervals = speed_intervals(rows[:q], rows[-q:])
    learner = result["learner"]
    first_version = rows[0]["draft_version"] if rows else None
    notes = (f"updates published {learner['updates_published']}, rejected {learner['updates_rejected']}, "
             f"draft version at the first request {first_version} (> 0: resumed from a checkpoint), "
             f"final draft version {learner['version']}, train seconds {learner['train_seconds']:.0f}")
    notes += "; " + start_vs_end(quarters["first quarter"], quarters["last quarter"], intervals)
    if sampled:
        notes += (f"; the other arms decoded {len(compared)} of {len(rows)} requests (--compare-every); each ratio to "
                  "them divides the online tok/s on those same requests")
    silent = {"online": (sum(r.get("alpha") is None for r in rows), len(rows))}
    if has_static:
        silent["static"] = (sum(r.get("static_alpha") is None for r in compared), len(compared))
    notes += ("; alpha columns average the requests where the draft proposed (k > 0); requests without proposals: "
              + ", ".join(f"{name} {n} of {total}" for name, (n, total) in silent.items()))
    if speed_png:
        notes += f"; tokens/s of every arm along the stream: `{speed_png}`"
    cfg = result["config"]
    emit_report("Online replay (`osd replay`)",
                f"{measured_command(result)} k={cfg['spec']['k']} loss={cfg['learn']['loss']} "
                f"mode={cfg['learn']['mode']} every_requests={cfg['learn']['every_requests']} lr={cfg['learn']['lr']}; "
                f"machine: {result.get('machine', machine())['cpu']}",
                [t, notes], path, markdown, plot=png)


def measured_command(result: dict) -> str:
    """The command that measured `result`: this process's own, or, for a report re-rendered from a finished JSON
    (`osd replay --from-result`), the recorded one with the revision and time it ran at."""
    if "command" not in result:
        return f"`{redacted_command(sys.argv[1:])}`"
    return f"`{result['command']}` (measured at rev {result.get('git_revision')}, {result.get('timestamp')})"


def mean_present(values) -> float | None:
    """Mean of the values that are not None (None if there are none): a request where the adaptive policy never let
    the draft propose has no alpha, which is not an alpha of 0."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


ARM_SPEED_KEYS = {"static": "static_tokens_per_second", "plain": "target_only_tokens_per_second",
                  "llama": "llama_cpp_target_tokens_per_second"}


def plot_replay(result: dict, path: str, window: int = 10) -> str | None:
    rows = result["requests"]
    curves = {"online (osd)": [r["alpha"] for r in rows]}  # None: no proposals (k = 0), a gap, not a 0
    if any("static_alpha" in r for r in rows):  # None where it did not run (--compare-every) or proposed nothing
        curves["control (never trained, served)"] = [r.get("static_alpha") for r in rows]
    return plot_alpha_curves(curves, domain_boundaries(rows), f"osd replay: {result['config']['stream']}", "alpha",
                             path, window)


SPEED_LABELS = {"online": "online (osd, learning)", "static": "control (never trained)", "plain": "osd target-only",
                "llama": "llama.cpp target-only"}  # the arms of report.ARM_SPEED_KEYS, and the online draft


def plot_live_speed(result: dict, path: str, window: int = 5) -> str | None:
    """Tokens/s against the request index on the requests every arm decoded (--compare-every), one line per arm:
    the live stream's headline as a curve. None without compared requests (or matplotlib)."""
    rows = [r for r in result["requests"] if "static_tokens_per_second" in r]
    if not rows:
        return None
    keys = {"online": "tokens_per_second", **ARM_SPEED_KEYS}
    curves = {SPEED_LABELS[arm]: [r.get(key) for r in rows] for arm, key in keys.items() if any(key in r for r in rows)}
    title = f"osd replay: {result['config']['stream']}, tokens/s on the {len(rows)} requests every arm decoded"
    return plot_alpha_curves(curves, domain_boundaries(result["requests"]), title, "tokens/s", path, window,
                             x=[r["i"] for r in rows])


def ratio_interval(numerators: list[float], denominators: list[float], paired: bool, draws: int = 2000,
                   seed: int = 0) -> tuple[float, float] | None:
    """95% bootstrap interval of mean(numerators) / mean(denominators) (pure, seeded): paired resamples request
    indices once for both (the same requests decoded by two arms), unpaired resamples each list on its own (two
    parts of the stream). None with fewer than 2 values on a side."""
    import random

    if min(len(numerators), len(denominators)) < 2:
        return None
    rng, ratios = random.Random(seed), []
    for _ in range(draws):
        a = [rng.randrange(len(numerators)) for _ in numerators]
        b = a if paired else [rng.randrange(len(denominators)) for _ in denominators]
        den = sum(denominators[i] for i in b)
        if den > 0:
            ratios.append(sum(numerators[i] for i in a) / len(a) / (den / len(b)))
    ratios.sort()
    return (ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]) if ratios else None


def speed_intervals(first: list[dict], last: list[dict]) -> dict:
    """95% intervals of the headline ratios: online last quarter / first quarter (every request of each), and online
    / each other arm on the last quarter's requests that arm decoded (paired)."""
    speeds = lambda part, key: [r[key] for r in part if r.get(key)]
    out = {"quarters": ratio_interval(speeds(last, "tokens_per_second"), speeds(first, "tokens_per_second"),
                                      paired=False)}
    for arm, key in ARM_SPEED_KEYS.items():
        both = [r for r in last if r.get(key) and r.get("tokens_per_second")]
        out[arm] = ratio_interval(speeds(both, "tokens_per_second"), speeds(both, key), paired=True)
    return out


def start_vs_end(first: dict, last: dict, intervals: dict | None = None) -> str:
    """The live replay's headline: online tokens/s in the last quarter of the stream over the first, and over each
    other arm in the last quarter, on the requests that arm decoded (dicts as report_replay's `quarters`: online,
    online_compared, static, plain, llama; None: that arm did not run); `intervals` (speed_intervals) adds each
    ratio's 95% interval."""
    def ratio(a, b, key):
        if not (a and b):
            return "n/a"
        ci = (intervals or {}).get(key)
        return f"{a / b:.2f}x" + (f" (95% CI {ci[0]:.2f}-{ci[1]:.2f})" if ci else "")

    parts = [f"online tok/s, last quarter / first quarter: {ratio(last['online'], first['online'], 'quarters')}"]
    for key, name in (("static", "the control"), ("plain", "osd target-only"), ("llama", "llama.cpp target-only")):
        if last.get(key) is not None:
            parts.append(f"last quarter online / {name}: {ratio(last['online_compared'], last[key], key)}")
    return "; ".join(parts)


def report_train_step(result: dict, out: str, markdown: str) -> None:
    path = write_result(result, out)
    secs, med = result["seconds_per_forward_backward"], result["median_seconds"]
    t = table([[name, med[name], min(secs[name]), max(secs[name])] for name in med],
              ["path", "median s / forward+backward", "min s", "max s"])
    cfg = result["config"]
    notes = (f"rows_only vs whole_layer: {result['speedup_rows_only']:.2f}x (median); mean context "
             f"{result['mean_context_tokens']:.0f} tokens, {result['mean_supervised_positions']:.0f} supervised positions "
             f"per item; largest loss difference {result['max_loss_difference']:.2e}, largest gradient difference "
             f"{result['max_relative_gradient_difference']:.2e} (relative to the tensor's largest entry); "
             f"bf16 vs fp32 rows_only: {result['speedup_bf16']:.2f}x (native bf16: {result['native_bf16']}), gradients "
             f"within {result['max_bf16_gradient_difference_l2']:.1%} (relative L2); clipping + AdamW "
             + ", ".join(f"{k} {1000 * v:.0f} ms" for k, v in result["optimizer_step_seconds"].items()))
    m = machine()
    emit_report("Training step (`osd bench train-step`)",
                f"`{redacted_command(sys.argv[1:])}`; {cfg['dataset']}/{cfg['split']} {cfg['requests']} requests, "
                f"{cfg['max_new_tokens']} tokens, trainable={cfg['trainable']} train_layers={cfg['train_layers']} "
                f"batch {cfg['batch_size']}, {cfg['repeats']} repeats after a warm-up; machine: {m['cpu']}, "
                f"{m['cores']} cores, torch threads {m['torch_threads']}",
                [t, notes], path, markdown)


def report_observe(result: dict, out: str, markdown: str) -> None:
    path = write_result(result, out)
    cfg = result["config"]
    rows = [[k, r["rows"], r["observe_ms"], r["top_k_ms"], r["positions_per_step"]]
            for k, r in result["per_sequence_step"].items()]
    t = table(rows, ["proposals", "rows", "observe ms / sequence-step", "of which top-k ms", "positions learnt"])
    m = machine()
    emit_report("A learning server's observation of each step (`osd bench observe`)",
                f"`{redacted_command(sys.argv[1:])}`; {cfg['context']} cached tokens, vocabulary {cfg['vocab']}, top "
                f"{cfg['top_k']}, median of {cfg['repeats']} after a warm-up; machine: {m['cpu']}, {m['cores']} cores, "
                f"torch threads {cfg['torch_threads']}", [t], path, markdown)


def report_rows(result: dict, out: str, markdown: str) -> None:
    path = write_result(result, out)
    rows = []
    for name, r in result["backends"].items():
        rows.append([name, f"{1000 * r['seconds'][0]:.1f}"] + [f"{c:.2f}" + ("" if ok else "*")
                                                                 for c, ok in zip(r["cost_vs_one_row"], r["bitwise_invariant"])])
    t = table(rows, ["backend", "ms / 1 row"] + [f"{n} rows" for n in range(1, 10)])
    notes = ("cost of one feed of n rows / one row (best of repeats, warm); * = some row's logits differ bitwise from "
             "the same position fed alone (the engine never verifies that many rows on that configuration)")
    cfg, m = result["config"], machine()
    emit_report("Verification cost by rows (`osd bench rows`)",
                f"`{redacted_command(sys.argv[1:])}` target={cfg['target']} context={cfg['context']} threads="
                f"{cfg['threads'] or 'default'}; machine: {m['cpu']} ({m['cpu_flags']}), {m['cores']} cores",
                [t, notes], path, markdown)


def report_calibration(result: dict, out: str, markdown: str) -> None:
    path = write_result(result, out)
    cfg, m, est = result["config"], machine(), result["estimators"]
    names = list(est)
    rows = [[n] + ["{min:.2f}-{max:.2f}".format(**est[e]["by_rows"][n]) for e in names]
            for n in est[names[0]]["by_rows"]]
    t = table(rows, ["rows"] + [f"{e}: range over calibrations" for e in names])
    notes = "; ".join(f"{e}: mean spread {est[e]['mean_spread']:.3f}" for e in names) + \
        "; one row " + ", ".join(f"{x:.1f}" for x in result["one_row_ms"]) + " ms"
    emit_report("Startup calibration, repeated (`osd bench calibration`)",
                f"`{redacted_command(sys.argv[1:])}`; a pass by rows against one row over {cfg['times']} calibrations of "
                f"{cfg['timed_rounds']} timed rounds, k_max {cfg['k_max']}, {cfg['max_batch']} sequences; machine: "
                f"{m['cpu']} ({m['cpu_flags']}), {m['cores']} cores", [t, notes], path, markdown)


def report_passes(result: dict, out: str, markdown: str) -> None:
    path = write_result(result, out)
    rows = [[g["context"], g["sequences"], g["rows_each"], g["rows"], f"{1000 * g['seconds']:.1f}",
             f"{1000 * g['model_seconds']:.1f}", f"{1000 * g['rows_only_seconds']:.1f}"] for g in result["grid"]]
    t = table(rows, ["cached tokens", "sequences", "rows each", "rows", "ms measured", "ms model", "ms rows only"])
    m, e, model = machine(), result["mean_abs_relative_error"], result["pass_model"]
    notes = (f"model: the one-sequence curve at {model['base_context']} cached tokens + {1e3 * model['per_sequence']:.2f}"
             f" ms a sequence beyond the first, and per 1000 cached tokens {1e6 * model['per_sequence_context']:.2f} ms "
             f"a sequence and {1e6 * model['per_row_context']:.2f} ms a row; mean |error| {100 * e['model_seconds']:.1f}%"
             f" (rows alone {100 * e['rows_only_seconds']:.1f}%)")
    emit_report("Target pass cost by rows, sequences and context (`osd bench passes`)",
                f"`{redacted_command(sys.argv[1:])}` target={result['config']['target']}; machine: {m['cpu']} "
                f"({m['cpu_flags']}), {m['cores']} cores", [t, notes], path, markdown)
