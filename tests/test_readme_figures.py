"""README figures recomputed from the JSON results that back them: a figure that drifts from its file fails here."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def result(name: str) -> dict:
    return json.loads(next((ROOT / "benchmarks").rglob(name)).read_text())


def serve_vs(name: str):
    """An `osd bench serve-vs` result -> (result, records by (server, clients), aggregate tokens/s of (server, clients))."""
    r = result(name)
    by = {(x["server"], x["concurrency"]): x for x in r["records"]}
    return r, by, lambda s, c: by[(s, c)]["aggregate_tokens_per_s"]


def test_llama_cpp_row_costs_are_those_of_bench_kernel():
    cost = result("bench-kernel.json")["llama_cpp"]["cost_vs_one_row"]  # rows 1..8
    assert f"against {cost[1]:.2f} / {cost[3]:.2f} / {cost[7]:.2f}x for llama.cpp's forward" in README


def test_soak_memory_figures_are_those_of_the_soak_results():
    bundled = result("bench-soak-bundled-2.json")["server"]
    assert f"{bundled['rss_after_serial_warmup_bytes'] / 1e9:.2f} GB after the serial warm-up" in README
    assert f"peaked at {bundled['rss_peak_bytes'] / 1e9:.2f} GB" in README
    assert f"ended {bundled['rss_growth_from_serial_warmup_pct']:.1f}% above the warm-up" in README
    assert f"(medians of the two halves of the run {bundled['rss_median_growth_pct']:.1f}%)" in README
    tiny = result("bench-soak-tiny-4.json")["server"]
    assert f"RSS ended {tiny['rss_growth_from_serial_warmup_pct']:.1f}% above the warm-up" in README


def test_the_llama_cpp_identity_caveat_is_the_recorded_rate():
    r = result("bench-speed-v2-learned-llama512.json")
    differing, prompts = r["outputs_differing_from_osd_target"]["osd"], len(r["config"]["prompts"])
    assert f"differed from its own target-only output on {differing} of {prompts} prompts" in README.replace("\n", " ")


def scale_figures() -> str:
    """The README's scale-out sentence, recomputed from the three `osd bench scale` results."""
    arms = {f"{r['replicas']}x{r['threads']}": r for r in result("bench-scale.json")["records"]}
    one, two, both = arms["1x1"], arms["2x1"], arms["1x2"]
    tok = lambda r: r["aggregate_tokens_per_s"]
    swap = max(s for r in arms.values() for s in r["publish"]["publish_to_swap_seconds"])
    replay = result("bench-scale-replay.json")
    alone = replay["alone"]
    faults = {p["fault"]: p for p in result("bench-scale-faults.json")["phases"]}
    return (f"one replica on one core {tok(one):.1f} tokens/s, two replicas on a core each {tok(two):.1f} "
            f"({tok(two) / tok(one):.2f}x), one replica on both cores {tok(both):.1f}; "
            f"a published version served by every replica within {swap:.2f} s; "
            f"{two['bytes_per_sample']:.0f} bytes a sample; "
            f"held-out alpha {replay['pooled']['alpha']:.3f} for one learner fed by both replicas against "
            f"{alone[0]['alpha']:.3f} / {alone[1]['alpha']:.3f} for each learning alone "
            f"(z {alone[0]['pooled_vs_this']['z']:.1f} / {alone[1]['pooled_vs_this']['z']:.1f}; never trained "
            f"{replay['control_alpha']:.3f}); "
            f"kill -9 of a replica: {faults['replica']['ok']}/{faults['replica']['requests']} answered; "
            f"of the learner: {faults['learner']['ok']}/{faults['learner']['requests']}; "
            f"of the front: {faults['front']['ok']}/{faults['front']['requests']}")


def test_scale_out_figures_are_those_of_bench_scale():
    assert scale_figures() in README.replace("\n", " ")


def test_what_ray_costs_is_that_of_the_no_ray_runs():
    t = lambda name: [r["aggregate_tokens_per_s"] for r in result(name)["records"]]
    off, on, before = t("bench-scale-noray-48-nolearn.json"), t("bench-scale-noray-48-flow.json"), \
        t("bench-scale-noray-48.json")
    figure = (f"learning off, {off[0]:.1f} tokens/s without Ray against {off[1]:.1f} through one Ray replica; learning "
              f"on, {on[0]:.1f} against {on[1]:.1f} (before the fix below, {before[0]:.1f} against {before[1]:.1f})")
    assert figure in README.replace("\n", " ")


def test_the_learners_work_in_the_ray_cost_run_is_the_recorded_one():
    plain, ray_arm = result("bench-scale-noray-48-steps.json")["records"]
    t = lambda r: r["aggregate_tokens_per_s"]
    figure = (f"in a run that also counted the learners' work, {t(plain):.1f} against {t(ray_arm):.1f}, and by the end "
              f"of the load the one-process learner had taken {plain['learner_at_load_end']['optimizer_steps']} "
              f"optimizer steps, the Ray learner {ray_arm['learner_at_load_end']['optimizer_steps']}")
    assert figure in README.replace("\n", " ")


def test_the_q4_row_costs_are_those_of_bench_rows():
    backends = result("bench-rows-osd-q4.json")["backends"]
    osd = backends["osd, own Q4_K kernel (q4_runner)"]
    llama = backends["llama.cpp, Q4_K repacked (default)"]
    cost = osd["cost_vs_one_row"]
    assert (f"one token {osd['seconds'][0] * 1e3:.1f} ms (llama.cpp {llama['seconds'][0] * 1e3:.1f}), 2 / 3 / 4 / 8 "
            f"tokens {cost[1]:.2f} / {cost[2]:.2f} / {cost[3]:.2f} / {cost[7]:.2f}x one token") in " ".join(README.split())


def test_the_intel_speed_headline_is_that_of_its_run():
    r = result("bench-speed-heal-v2.json")
    decode, e2e = r["decode_speedup_vs_baseline"], r["end_to_end_speedup_vs_baseline"]
    assert "Intel" in r["machine"]["cpu"] and r["config"]["models"]["draft"] == "derived:cheap-0.5b"
    assert (f"{decode['osd_q4']:.2f}x llama.cpp's decode with the first shipped draft `cheap-0.5b` and "
            f"{decode['osd_q4_learned']:.2f}x with `cheap-0.5b-v2`, as a fresh install serves it "
            f"({e2e['osd_q4']:.2f}x / {e2e['osd_q4_learned']:.2f}x end to end") in README.replace("\n", " ")


def test_the_v3_draft_and_tree_figures_are_those_of_their_runs():
    flat = " ".join(README.split())
    heal, v3 = result("heal-cheap-0.5b-v3.json"), result("bench-speed-v3.json")
    d3 = v3["decode_speedup_vs_baseline"]
    assert f"held-out greedy alpha **{heal['eval_after']['alpha_greedy']:.3f}** (v2: 0.330)" in flat
    assert f"v3 decodes at {d3['osd_q4_learned']:.2f}x llama.cpp against v2's {d3['osd_q4']:.2f}x" in flat
    assert v3["config"]["learned_draft"] == "derived:/work/runs/cheap-v3" and sum(v3["outputs_differing_from_osd_target"][a]
                                                                                  for a in ("osd_q4", "osd_q4_learned")) == 0
    trees = result("bench-speed-trees.json")
    d = trees["decode_speedup_vs_baseline"]
    q, qc = trees["trees"]["osd_q4_tree"]["spec_stats"], trees["osd_q4_spec_stats"]
    assert (f"osd chains (v2 draft + lookup) {d['osd_q4']:.2f}x, trees {d['osd_q4_tree']:.2f}x; trees took "
            f"{q['tokens_per_step']:.2f} tokens per step against the chains' {qc['tokens_per_step']:.2f} but verified "
            f"{q['rows_per_step']:.2f} rows per step") in flat
    assert f"Recycled trees with no draft at all: {d['osd_q4_recycle']:.2f}x against osd's target alone " \
           f"{d['osd_q4_target']:.2f}x" in flat
    assert all(trees["outputs_differing_from_osd_target"][a] == 0 for a in ("osd_q4", "osd_q4_tree", "osd_q4_recycle"))
    tree, recycle = trees["trees"]["osd_q4_tree"], trees["trees"]["osd_q4_recycle"]
    hit, runner = tree["recycled"]["hit_rate_by_rank"], tree["draft_runners_up"]["hit_rate_by_rank"]
    assert f"llama.cpp {trees['decode_tokens_per_second'][trees['baseline']]:.1f} tokens/s; osd chains" in flat
    assert (f"(recycled entries were the target's token {hit[0]:.2f} / {hit[1]:.2f} of the time at rank 1 / 2, the "
            f"draft's runners-up {runner[0]:.2f} / {runner[1]:.2f} where its best missed") in flat
    assert f"{d['osd_q4_target']:.2f}x ({recycle['spec_stats']['tokens_per_step']:.2f} tokens per step)" in flat


def test_the_feature_head_figures_are_those_of_its_run():
    r = result("feature-head.json")
    a = r["first_proposal_agreement"]
    flat = " ".join(README.split())
    assert (f"agrees with the target's first token after a step {a['feature_head']:.3f} of the time on "
            f"{r['heldout_positions']:,} held-out positions, the shipped `cheap-0.5b-v3` {a['cheap_draft']:.3f}") in flat


def test_the_q4_kernel_row_costs_are_those_of_bench_kernel():
    cost = result("bench-kernel.json")["model_pass"]["cost_vs_one_row"]  # rows 1..8
    assert (f"1 / 2 / 4 / 8 rows cost {cost[0]:.2f} / {cost[1]:.2f} / {cost[3]:.2f} / {cost[7]:.2f}x one row"
            in " ".join(README.split()))
    ms = result("bench-kernel-cpu-x16-rerun.json")["model_pass"]["ms"]
    before = result("bench-kernel-cpu.json")["model_pass"]["ms"]
    assert (f"one thread: 1 / 4 / 8 rows = {ms[0]:.0f} / {ms[3]:.0f} / {ms[7]:.0f} ms, "
            f"`benchmarks/bench-kernel-cpu-x16-rerun.json`; {before[0]:.0f} / {before[3]:.0f} / {before[7]:.0f} ms before "
            "its columns were interleaved") in " ".join(README.split())


def test_the_ray_memory_and_projection_figures_are_those_of_bench_scale():
    flat = " ".join(README.split())
    r = result("bench-scale.json")
    learner = [x["learner"]["peak_rss_bytes"] / 1e9 for x in r["records"]]
    idle = [x["ray_idle_rss_bytes"] / 1e9 for x in r["records"]]
    start = [x["ray_start_seconds"] for x in r["records"]]
    replica = [b / 1e9 for x in r["records"] for b in x["replica_peak_rss_bytes"]]
    assert all(abs(b - 3.0) < 0.15 for b in replica)  # "~3.0 GB"
    assert (f"the learner {min(learner):.1f}-{max(learner):.1f} GB (fp32 master, Adam moments, the drift guard's "
            f"copies, the average), Ray itself {min(idle):.2f}-{max(idle):.2f} GB idle and {min(start):.1f}-"
            f"{max(start):.1f} s to start; a version ships {r['projection']['publish_payload_bytes'] / 1e6:.1f} MB once") in flat
    p = r["projection"]
    assert (f"{p['samples_per_s_per_replica']:.1f} samples/s per replica x {p['bytes_per_sample']:,.0f} B = "
            f"{p['network_bytes_per_s_per_replica'] / 1e3:.0f} kB/s per replica to the learner, which takes a sample in "
            f"{p['learner_ingest_seconds_per_sample'] * 1e3:.2f} ms: one learner ingests the samples of "
            f"~{p['replicas_one_learner_ingests']:.0f} such replicas") in flat


def test_the_evidence_table_is_that_of_evidence_json():
    rows = {}
    for line in README.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| replay-"):
            rows[cells[0]] = cells
    signed = lambda x: f"{x:+.3f}"  # noqa: E731
    ev = result("evidence.json")
    assert len(rows) == len(ev["rows"])
    for row in ev["rows"]:
        a, z = row["alpha"], row["z_vs_control"]
        arrival = a["offline_arrival"]
        want = [row["run"], row["draft"].removeprefix("derived:"), str(row["requests"]), row["dataset"],
                f"{a['original']:.3f}", f"{a['online']:.3f}", f"{signed(row['gain'])} ({z['online']:.1f})",
                f"{a['offline_10pct']:.3f}", f"{a['offline_100pct']:.3f}",
                f"{signed(row['gap'])} ({row['online_vs_offline_z']:.1f})",
                "-" if arrival is None else f"{arrival:.3f}",
                "-" if arrival is None else f"{signed(a['online'] - arrival)} ({row['online_vs_arrival_z']:.1f})",
                f"{row['steps']['online']} / {row['steps']['offline_100pct']}"]
        assert rows[row["run"]] == want, row["run"]


def test_the_teacher_figures_are_those_of_bench_teacher():
    arms = result("bench-teacher.json")["arms"]
    eight, one = arms["osd Q4, 8 prompts at once"], arms["osd Q4, one prompt at a time"]
    assert (f"{eight['vs_first_arm']:.1f}x llama.cpp's tokens/s with 8 prompts, "
            f"{eight['tokens_per_second'] / one['tokens_per_second']:.1f}x the Q4 kernel one prompt at a time") \
        in " ".join(README.split())


def test_the_heal_figures_are_those_of_the_heal_results():
    flat = " ".join(README.split())
    v3, v2, v1 = result("heal-cheap-0.5b-v3.json"), result("heal-cheap-0.5b-v2.json"), result("heal-cheap-0.5b.json")
    losses = ", ".join(f"{x:.2f}" for x in v3["loss_by_epoch"])
    assert f"by epoch {losses})" in flat
    assert (f"{v3['optimizer_steps']} optimizer steps, {v3['seconds'] / 60:.0f} min on the 2-core AMD EPYC (teacher "
            f"{v3['teacher_seconds'] / 60:.0f} min, training {v3['train_seconds'] / 60:.0f} min") in flat
    assert (f"sampled alpha at T = 1 {v3['eval_after']['alpha_sampling_t1']:.3f} "
            f"(v2: {v2['eval_after']['alpha_sampling_t1']:.3f})") in flat
    assert f"(v2: {v2['eval_after']['alpha_greedy']:.3f})" in flat
    assert f"{v2['seconds'] / 60:.0f} min on 2 cores" in flat
    assert (f"held-out greedy alpha {v2['eval_after']['alpha_greedy']:.3f} on the {v2['eval_after']['requests']} "
            f"test prompts") in flat
    assert (f"(held-out greedy alpha {v1['eval_after']['alpha_greedy']:.3f} after a {v1['seconds'] / 60:.0f}-minute "
            f"heal") in flat


def test_the_tiny_soak_buffer_figures_are_those_of_its_run():
    r = result("bench-soak-tiny-4.json")
    s, lr = r["server"], r["learner"]
    grown = (s["rss_end_bytes"] - s["rss_start_bytes"]) / 2 ** 20
    buffers = (lr["memory_buffers_bytes_end"] - lr["memory_buffers_bytes_start"]) / 2 ** 20
    assert (f"of the {grown:.0f} MiB it grew after the concurrent warm-up rounds, {buffers:.0f} MiB are the learner's "
            f"buffers") in " ".join(README.split())


def test_the_router_figures_are_those_of_their_runs():
    flat = " ".join(README.split())
    r450 = result("replay-routed-cheap450.json")
    h, t = r450["heldout"], r450["timings"]
    assert (f"the router sends {h['router_accuracy']:.2f} of held-out requests to their domain's draft at "
            f"{(t['route'] + t['score']) / t['replay'] * 100:.1f}% of the replay's time") in flat
    p = h["pooled"]
    assert (f"one shared online draft reaches {p['shared']:.3f} held-out (control {p['control']:.3f}), the oracle "
            f"split {p['oracle']:.3f}, the routed drafts {p['routed']:.3f}") in flat
    fork = result("routed-fork150.json")["heldout"]["pooled"]
    assert f"gives the oracle {fork['oracle']:.3f} against shared {fork['shared']:.3f}" in flat
    ml4 = result("routed-ml4-1000.json")["heldout"]
    q = ml4["pooled"]
    assert f"serves the label's draft on {ml4['router_accuracy']:.2f} of held-out requests" in flat
    assert (f"held-out {q['shared']:.3f} against {q['oracle']:.3f} (oracle) and {q['routed']:.3f} (routed), "
            f"control {q['control']:.3f}") in flat
    served = result("bench-serve-routed-learning-routed5.json")
    assert (f"routing and scoring take {served['levels'][0]['routing']['share'] * 100:.2f}% of serving time at "
            f"concurrency 1, and the five drafts hold {served['drafts_memory']['ratio']:.3f}x") in flat


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (bench/plots.py's, without its gaps: fast replays have none)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / len(values[max(0, i + 1 - window):i + 1])
            for i in range(len(values))]


def shift_segments(r: dict, window: int = 10) -> dict:
    """Per segment of a sharp-shift replay: its recovery bound (offline-100% held-out alpha), the online and control
    moving averages, and the requests after which the online one stays within 0.05 of the bound (None: never), as
    bench/replay_fast_report.py's `recovery` counts them."""
    out, order = {}, []
    for row in r["requests"]:
        if row["domain"] not in out:
            order.append(row["domain"])
            out[row["domain"]] = []
        out[row["domain"]].append(row)
    segs = {}
    for d in order:
        part, bound = out[d], r["end_of_stream_alpha_on_heldout"][d]["offline_100pct"]
        curve = {k: moving_average([x[f"{k}_alpha"] for x in part], window) for k in ("online", "original")}
        reached = None
        for i, a in enumerate(curve["online"][window - 1:], start=window):
            reached = (reached or i) if a >= bound - 0.05 else None
        first = next(i for i, a in enumerate(curve["online"], start=1) if i >= window and a >= bound - 0.05)
        segs[d] = {"bound": bound, "curve": curve, "recovered": reached, "first": first,
                   "control_mean": sum(x["original_alpha"] for x in part) / len(part)}
    return segs


def test_the_300_request_shift_figures_are_those_of_replay_v2_shift1200():
    flat = " ".join(README.split())
    r = result("replay-v2-shift1200.json")
    s = shift_segments(r)
    assert (f"back within 0.05 for good after **{s['spider']['recovered']} requests on spider and "
            f"{s['finance']['recovered']} on finance**") in flat
    below = {d: s[d]["bound"] - s[d]["control_mean"] for d in ("spider", "finance")}
    assert f"its segment means sit {below['spider']:.3f} and {below['finance']:.3f} below" in flat
    code = s["code"]
    assert code["recovered"] is None
    assert (f"it first reaches the line after {code['first']} requests but ends at {code['curve']['online'][-1]:.3f} "
            f"against {code['bound'] - 0.05:.3f}") in flat
    h = r["end_of_stream_alpha_on_heldout"]["code"]
    assert f"within {h['offline_100pct'] - h['online']:.3f} of the offline draft" in flat
    own, change = {}, {}
    for point in r["heldout_after_each_segment"]:
        for d, x in point["heldout"].items():
            if point["last_domain"] == d:
                own.setdefault(d, x["online"])
            if d in own:
                change[d] = x["online"] - own[d]
    worst = min(change, key=change.get)
    assert f"Old domains lose at most {-change[worst]:.3f} held-out there ({worst};" in flat
    z = [v["online"]["z"] for v in r["heldout_vs_control"].values()]
    assert f"control (z {min(z):.1f} to {max(z):.1f})" in flat


def test_the_100_request_shift_figures_are_those_of_replay_v2_shift400():
    flat = " ".join(README.split())
    r = result("replay-v2-shift400.json")
    s = shift_segments(r)
    assert (f"the draft is back by the end of finance and code ({s['finance']['recovered']} and "
            f"{s['code']['recovered']} of 100 requests). On spider it touches the bound after {s['spider']['first']} "
            f"requests, then falls back out") in flat
    assert s["spider"]["recovered"] is None
    points = r["heldout_after_each_segment"]
    end, own = points[-1]["heldout"], {p["last_domain"]: p["heldout"][p["last_domain"]]["online"] for p in points}
    kept = ", ".join(f"{d} {end[d]['online'] - own[d]:+.3f}" for d in ("spider", "finance"))
    assert f"(gsm8k {end['gsm8k']['online'] - own['gsm8k']:+.3f}, {kept}; target:" in flat
    z = [v["online"]["z"] for v in r["heldout_vs_control"].values()]
    assert f"Each domain ends above the control (z {min(z):.1f} to {max(z):.1f})" in flat
    first = points[0]["heldout"]["spider"]
    assert f"(after 100 gsm8k requests: spider {first['online'] - first['control']:.3f})" in flat
    h, vs = r["end_of_stream_alpha_on_heldout"], r["heldout_online_vs_offline_100pct"]
    early = [h[d]["offline_100pct"] - h[d]["online"] for d in ("gsm8k", "spider", "finance")]
    zs = [vs[d]["z"] for d in ("gsm8k", "spider", "finance")]
    assert (f"the online draft ends {min(early):.3f}-{max(early):.3f} below the offline draft on the three earlier "
            f"domains (z {max(zs):.1f} to {min(zs):.1f}) and {h['code']['offline_100pct'] - h['code']['online']:.3f} "
            f"below on code") in flat


def test_the_older_0_5b_replay_figures_are_those_of_their_runs():
    flat = " ".join(README.split())
    spider = result("replay-fast-spider500.json")
    h = spider["end_of_stream_alpha_on_heldout"]["spider"]
    assert f"on 40 unseen requests was {h['online']:.3f} against {h['original']:.3f} for the never-trained control" in flat
    c = spider["config"]
    steps = c["baseline_epochs"] * -(-len(spider["requests"]) // c["learn"]["batch_size"])
    assert (f"had {steps} optimizer steps (2 epochs of 500 requests in batches of 8: the JSON keeps the recipe, not the "
            f"count) to the online draft's {spider['learner']['optimizer_steps']}") in flat
    code = result("replay-fast-code500.json")["end_of_stream_alpha_on_heldout"]["code"]
    gsm = result("replay-fast-gsm8k500.json")["end_of_stream_alpha_on_heldout"]["gsm8k"]
    assert (f"(code {code['online']:.3f} online / {code['original']:.3f} control; gsm8k {gsm['online']:.3f} / "
            f"{gsm['original']:.3f})") in flat
    assert (f"agrees with the target on ~{min(code['original'], gsm['original']):.2f}-"
            f"{max(code['original'], gsm['original']):.2f} of greedy tokens on code and gsm8k (held-out, "
            f"`benchmarks/replay-fast-code500.json`, `replay-fast-gsm8k500.json`)") in flat
    shift = result("replay-fast-shift600.json")
    parts = {}
    for row in shift["requests"]:
        parts.setdefault(row["domain"], []).append(row)
    first = {}
    for key in ("original", "online"):
        for d, part in parts.items():
            bound = sum(x["offline_100pct_alpha"] for x in part) / len(part)  # in-stream: the run has no held-out
            curve = moving_average([x[f"{key}_alpha"] for x in part], 10)
            first.setdefault(key, []).append(next(i for i, a in enumerate(curve, start=1) if i >= 10 and a >= bound - 0.05))
    assert (f"(first within it after {' / '.join(map(str, first['original']))} requests, online "
            f"{' / '.join(map(str, first['online']))};") in flat
    guard = result("replay-fast-spider240.json")["learner"]
    assert (f"rejected {guard['updates_rejected']} of {guard['updates_published'] + guard['updates_rejected']} updates "
            f"on a spider stream") in flat


def test_the_cheap_draft_shape_and_cost_figures_are_those_of_their_files():
    flat = " ".join(README.split())
    shipped = json.loads((ROOT / "src/osd/assets/drafts/cheap-0.5b-v3/derived.json").read_text())["derive"]
    assert f"head over {shipped['vocab']:,} tokens (`--vocab`" in flat and shipped["layers"] == "0,23"
    c = {(r["layers"], r["vocab"]): r["c"] for r in result("draft-cost-wall2.json")["rows"]}
    four = [v for (layers, _), v in c.items() if layers == 4]
    assert (f"({c[(2, 8192)]:.2f}-{c[(2, 16384)]:.2f} at 8,192 / 16,384 head rows; 4 layers {min(four):.2f}-"
            f"{max(four):.2f}: `osd draft cost`, `benchmarks/draft-cost-wall2.json`)") in flat
    cut = result("draft-heal-smoke.json")["eval_before"]
    assert f"({cut['alpha_greedy']:.3f} of greedy tokens on {cut['requests']} test prompts before a smoke heal" in flat


def test_the_learning_speed_beside_serving_is_that_of_the_paired_run():
    flat = " ".join(README.split())
    r = result("bench-serve-speculative-learning-paired-parked.json")
    steps, seconds = r["optimizer_steps_learning"], r["learning_wall_seconds"]
    assert f"only ~{steps / seconds * 60:.0f} optimizer steps a minute ({steps} in its {seconds:.0f} s of learning rounds)" in flat
    t = r["tpot_p50_ratio"]
    assert f"is {t['ratio']:.3f}x that with it paused (95% interval {t['ci95'][0]:.3f}-{t['ci95'][1]:.3f};" in flat
    assert f"costs {t['ratio']:.3f}x p50 time per output token (95% interval {t['ci95'][0]:.3f}-{t['ci95'][1]:.3f};" in flat


def test_the_sample_and_adapter_sizes_are_those_of_their_files():
    flat = " ".join(README.split())
    sample = result("bench-scale.json")["projection"]["bytes_per_sample"]
    assert f"(top-64 target distributions, ~{sample / 1e3:.0f} kB a step in `benchmarks/bench-scale.json`" in flat
    adapter = (ROOT / "src/osd/assets/drafts/cheap-0.5b-v2/derived.safetensors").stat().st_size
    assert f"3 epochs, {adapter / 1e6:.0f} MB; " in flat


def live_quarters(name: str) -> dict:
    """First and last quarter of a live replay: mean online tok/s over all its requests and over the requests the
    other arms also decoded (--compare-every), those arms' tok/s there, and live acceptance (bench/replay_live's table)."""
    rows = result(name)["requests"]
    n = len(rows) // 4
    out = {}
    for quarter, part in (("first", rows[:n]), ("last", rows[-n:])):
        compared = [x for x in part if x.get("static_tokens_per_second") is not None]
        mean = lambda key, xs: sum(x[key] for x in xs) / len(xs)  # noqa: E731
        out[quarter] = {"online": mean("tokens_per_second", part), "alpha": mean("alpha", part),
                        **{k: mean(f"{k}tokens_per_second", compared) for k in ("", "static_", "target_only_",
                                                                               "llama_cpp_target_")}}
    return out


def test_the_live_figures_are_those_of_the_live_replays():
    flat = " ".join(README.split())
    q = live_quarters("replay-live-v2-code600.json")
    first, last = q["first"], q["last"]
    assert (f"the last quarter ran at **{last[''] / last['static_']:.2f}x the never-trained draft on the same requests "
            f"(95% CI 1.25-1.39)**, {last[''] / last['target_only_']:.2f}x osd's target alone and "
            f"**{last[''] / last['llama_cpp_target_']:.2f}x llama.cpp's target alone**") in flat
    assert (f"Live acceptance rose {first['alpha']:.2f} -> {last['alpha']:.2f}, and the machine held steady (osd's "
            f"target alone {first['target_only_']:.1f} -> {last['target_only_']:.1f} tok/s)") in flat
    assert f"Start to end by quarters, the figure is {last['online'] / first['online']:.2f}x (CI 1.17-1.25)" in flat
    short = {n: live_quarters(f"replay-live-v2-code{n}.json")["last"] for n in (200, 280)}
    assert (f"200 requests, {short[200][''] / short[200]['static_']:.2f}x the never-trained draft; 280 requests, "
            f"{short[280][''] / short[280]['static_']:.2f}x") in flat


def test_the_arrival_order_and_lever_figures_are_those_of_the_code_reruns():
    flat = " ".join(README.split())
    held = lambda name: result(name)["end_of_stream_alpha_on_heldout"]  # noqa: E731
    arrival = []
    for domain, name in (("code", "replay-v2-code600-arrival.json"), ("finance", "replay-v2-finance500-arrival.json"),
                         ("gsm8k", "replay-v2-gsm8k500-arrival.json")):
        h, z = held(name)[domain], result(name)["heldout_online_vs_offline_arrival"][domain]["z"]
        arrival.append(h["offline_100pct"])
        online = "online " if domain == "code" else ""
        assert (f"{domain}: {h['offline_arrival']:.3f} against {online}{h['online']:.3f} "
                f"({h['online'] - h['offline_arrival']:+.3f}, z {z:.2f}") in flat, domain
    assert f"reach {arrival[0]:.3f}, {arrival[1]:.3f} and {arrival[2]:.3f}." in flat
    base = held("replay-cheap-v2-code600.json")["code"]["online"]
    lever = {k: held(f"replay-v2-code600-{k}.json")["code"] for k in ("res1024", "spu2", "uniform", "sweep")}
    gap = lambda h: h["online"] - h["offline_100pct"]  # noqa: E731
    sweep_z = result("replay-v2-code600-sweep.json")["heldout_online_vs_offline_100pct"]["code"]["z"]
    assert f"a rehearsal reservoir that keeps every request ({lever['res1024']['online'] - base:+.3f});" in flat
    assert f"a quarter of the steps (gap {gap(lever['spu2']):.3f});" in flat
    assert (f"(`--rehearsal-uniform`: {lever['uniform']['online'] - base:+.3f}, the gap widens to "
            f"{gap(lever['uniform']):.3f})") in flat
    assert f"(`--sweep`: {lever['sweep']['online'] - base:+.3f}, gap {gap(lever['sweep']):.3f}, z {sweep_z:.1f})" in flat


def test_the_published_update_size_is_that_of_bench_scale():
    sizes = {r["publish"]["payload_bytes"] for r in result("bench-scale.json")["records"]}
    assert len(sizes) == 1
    assert (f"(int8 where the copy is quantized: {sizes.pop() / 1e6:.0f} MB for the shipped draft, the same file's "
            f"`payload_bytes`)") in " ".join(README.split())


def test_the_intel_llama_cpp_decode_and_q4_target_ranges_are_those_of_the_intel_runs():
    runs = [result(n) for n in ("bench-speed-heal-v2.json", "bench-speed-v2-learned-llama512.json")]
    assert all("Intel" in r["machine"]["cpu"] for r in runs)
    llama = [r["decode_tokens_per_second"]["llama_cpp_target"] for r in runs]
    q4 = [r["decode_speedup_vs_baseline"]["osd_q4_target"] for r in runs]
    flat = " ".join(README.split())
    assert f"llama.cpp decodes the target alone at {min(llama):.1f}-{max(llama):.1f} tokens/s" in flat
    assert f"osd on its Q4 kernel decodes it at {min(q4):.2f}-{max(q4):.2f}x that" in flat


def test_the_amd_q4_target_range_is_that_of_the_amd_speed_runs():
    q4 = [r["decode_speedup_vs_baseline"]["osd_q4_target"]
          for r in map(result, sorted(p.name for p in (ROOT / "benchmarks").rglob("bench-speed-*.json")))
          if r["machine"]["cpu"] == "AMD EPYC" and r.get("baseline") == "llama_cpp_target"
          and "osd_q4_target" in r.get("decode_speedup_vs_baseline", {})
          and not r["command"].count("-x16")]  # the runs before the columns were interleaved
    assert len(q4) >= 10
    assert (f"the kernel before its columns were interleaved was {min(q4):.2f}-{max(q4):.2f}x llama.cpp alone"
            in " ".join(README.split()))


def test_the_best_amd_learned_draft_range_is_that_of_its_speed_runs():
    runs = {}
    for path in sorted((ROOT / "benchmarks").rglob("bench-speed-*.json")):
        r = result(path.name)
        if r["machine"]["cpu"] == "AMD EPYC" and "osd_q4_learned" in r.get("decode_speedup_vs_baseline", {}):
            runs.setdefault(r["config"]["learned_draft"], []).append(r["decode_speedup_vs_baseline"]["osd_q4_learned"])
    best = max(runs.values(), key=max)
    assert len(best) == 4 and best is runs["/work/runs/ckpt-cheap-code600-avg"]
    assert (f"the best learned draft reached {min(best):.2f}-{max(best):.2f}x llama.cpp's decode (its four runs, "
            f"`bench-speed-learned-code600-average*.json` and `-lookup*.json`)") in " ".join(README.split())


def test_the_serve_vs_table_and_its_reading_are_those_of_bench_serve_vs_prefix():
    r = result("bench-serve-vs-prefix.json")
    flat = " ".join(README.split())
    by = {(x["server"], x["concurrency"]): x for x in r["records"]}
    tok = lambda server, c: by[(server, c)]["aggregate_tokens_per_s"]  # noqa: E731
    gb = lambda server, c: by[(server, c)]["peak_rss_bytes"] / 1e9  # noqa: E731
    p95 = lambda server, c: by[(server, c)]["ttft_p95_s"]  # noqa: E731
    levels = r["config"]["levels"]
    assert levels == [1, 2, 4, 8, 16] and f"bench-serve-vs-prefix.json`, rev {r['git_revision']}, 2-core AMD" in flat
    for c in levels:
        base = tok("llama-server", c)
        cells = [f"{base:.1f}"] + [f"{tok(s, c):.1f} ({tok(s, c) / base:.2f}x)" for s in ("osd", "osd-learning",
                                                                                        "osd-target-only")]
        cells += [f"{p95('llama-server', c):.2f} / {p95('osd', c):.2f} s", f"{gb('osd', c):.2f} / {gb('osd-learning', c):.2f} GB"]
        assert f"| {c} | " + " | ".join(cells) + " |" in README, c
    same = [v for arm in r["identity"].values() for v in arm.values()]
    assert all(v["same"] == v["of"] for v in same) and len(r["identity"]) == 2
    assert f"({sum(v['same'] for v in same) // 2} of {sum(v['of'] for v in same) // 2} per arm)" in flat
    prefill = {p["server"]: p for p in r["prefill"]}
    osd, llama = prefill["osd"]["prompt_tokens_per_s"], prefill["llama-server"]["prompt_tokens_per_s"]
    assert (f"Prefill of one {prefill['osd']['prompt_tokens']:,}-token prompt alone: osd {osd:.0f} prompt tokens/s, "
            f"llama-server {llama:.0f} ({osd / llama:.2f}x") in flat
    name = lambda c: f"{c} client{'s' if c > 1 else ''}"  # noqa: E731
    goal = {1: 1.3, 2: 1.3, 4: 2.0, 8: 2.0, 16: 2.0}
    ratio = {c: tok("osd", c) / tok("llama-server", c) for c in levels}
    met = [f"{ratio[c]:.2f}x at {name(c)}" for c in levels if ratio[c] >= goal[c]]
    better = [c for c in levels if p95("osd", c) <= p95("llama-server", c)]
    worse = [c for c in levels if p95("osd", c) > p95("llama-server", c)]
    met += ["TTFT p95 at " + ", ".join(map(str, better)) + " clients"] if better else []
    cost = {c: 1 - tok("osd-learning", c) / tok("osd", c) for c in levels}
    met += [f"learning's cost at 8 clients ({cost[8] * 100:.0f}%)"] if cost[8] <= 0.10 else []
    short = [f"{ratio[c]:.2f}x at {name(c)} (target {goal[c]:.1f}x)" for c in levels if ratio[c] < goal[c]]
    short += [f"learning's cost at 8 clients ({cost[8] * 100:.0f}%, target 10%)"] if cost[8] > 0.10 else []
    assert f"met: {', '.join(met)}; peak RSS at 16 clients {gb('osd', 16):.2f} GB (learning on {gb('osd-learning', 16):.2f} GB)" in flat
    ab = result("bench-serve-vs-c4-abba-prefix.json")["records"]
    ab_tok = {n: [x["aggregate_tokens_per_s"] for x in ab if x["server"] == n] for n in ("osd", "osd-target-only", "llama-server")}
    ab_c4 = sum(ab_tok["osd"]) / sum(ab_tok["llama-server"])
    assert (f"short: {', '.join(short) or 'none'} in this run; 4 clients at {ab_c4:.2f}x in the alternating run below "
            "(target 2.0x). Beyond a few rows") in flat and gb("osd-learning", 16) <= 6.0
    ab_acc = [x["acceptance_rate"] for x in ab if x["server"] == "osd"]
    assert (f"and {sum(ab_tok['osd']) / sum(ab_tok['osd-target-only']):.2f}x after it (`bench-serve-vs-c4-abba-prefix.json`, "
            f"acceptance {sum(ab_acc) / len(ab_acc):.2f})") in flat
    assert (f"{tok('osd', 4) / tok('llama-server', 4):.2f}x llama-server in this run's 4-client slice, but {ab_c4:.2f}x "
            f"on the first slice with the arms alternating (osd {' and '.join(f'{v:.1f}' for v in ab_tok['osd'])}, "
            f"llama-server {' and '.join(f'{v:.1f}' for v in ab_tok['llama-server'])} tokens/s") in flat
    assert f"their ratio ({tok('osd', 8) / tok('osd-target-only', 8):.2f}x at 8 clients) is the noise" in flat
    joint = result("bench-serve-vs-joint.json")
    jb = {(x["server"], x["concurrency"]): x for x in joint["records"]}
    jt = lambda server, c: jb[(server, c)]["aggregate_tokens_per_s"]  # noqa: E731
    jsame = [v for arm in joint["identity"].values() for v in arm.values()]
    assert all(v["same"] == v["of"] for v in jsame) and joint["config"]["levels"] == levels
    assert (f"(`bench-serve-vs-joint.json`, rev {joint['git_revision']}, the same prompts): osd "
            + " / ".join(f"{jt('osd', c) / jt('llama-server', c):.2f}x" for c in levels) + " llama-server at 1 / 2 / 4 / 8 / 16 "
            "clients, target-only " + " / ".join(f"{jt('osd-target-only', c) / jt('llama-server', c):.2f}x" for c in levels)
            + f", learning's cost at 8 clients {(1 - jt('osd-learning', 8) / jt('osd', 8)) * 100:.0f}%, TTFT p95 "
            + " / ".join(f"{jb[('osd', c)]['ttft_p95_s']:.2f}" for c in levels) + " against llama-server's "
            + " / ".join(f"{jb[('llama-server', c)]['ttft_p95_s']:.2f}" for c in levels)
            + f" s, greedy identity {sum(v['same'] for v in jsame) // 2} of {sum(v['of'] for v in jsame) // 2} per arm") in flat
    in_process = {(x["arm"], x["concurrency"]): x for x in result("bench-scheduler-prefix.json")["records"]}[("target-only", 4)]
    assert f"the prompt rows, {in_process['prefill_rows']} of {in_process['rows']} rows at 4 clients in-process" in flat
    if worse:
        assert ("TTFT p95 is worse than llama-server's at " + " and ".join(
            f"{name(c)} ({p95('osd', c):.2f} vs {p95('llama-server', c):.2f} s)" for c in worse)) in flat
    else:
        assert ("TTFT p95 is no worse than llama-server's at any level (" + " / ".join(f"{p95('osd', c):.2f}" for c in levels)
                + " s against " + " / ".join(f"{p95('llama-server', c):.2f}" for c in levels) + ")") in flat
    vs = lambda rec: " / ".join(f"{rec[('osd', c)] / rec[('osd-target-only', c)]:.2f}x" for c in levels)  # noqa: E731
    teams = {(x["server"], x["concurrency"]): x["aggregate_tokens_per_s"] for x in result("bench-serve-vs-teams.json")["records"]}
    assert (f"against osd target-only {vs({k: x['aggregate_tokens_per_s'] for k, x in by.items()})} at 1 / 2 / 4 / 8 / 16 "
            f"clients in this run ({vs(teams)} in `bench-serve-vs-teams.json`") in flat
    assert f"(mean k {by[('osd', 8)]['mean_k']:.2f} / {by[('osd', 16)]['mean_k']:.2f})" in flat
    assert (f"(mean k {by[('osd', 4)]['mean_k']:.2f}, acceptance {by[('osd', 4)]['acceptance_rate']:.2f})") in flat
    assert f"the speculative server was {tok('osd', 4) / tok('osd-target-only', 4):.2f}x of target-only there" in flat
    assert (f"in this run {' / '.join(f'{cost[c] * 100:.0f}%' for c in levels)} of the aggregate at 1 / 2 / 4 / 8 / 16 "
            "clients") in flat
    steps = " / ".join(str(by[("osd-learning", c)]["learner_optimizer_steps"]) for c in levels)
    assert f"with {steps} optimizer steps at 1 / 2 / 4 / 8 / 16 clients" in flat
    lazy = {(x["server"], x["concurrency"]): x for x in result("bench-serve-vs-lazy.json")["records"]}
    lazy_cost = [1 - lazy[("osd-learning", c)]["aggregate_tokens_per_s"] / lazy[("osd", c)]["aggregate_tokens_per_s"]
                 for c in levels]
    assert (f"(`bench-serve-vs-lazy.json`) {min(lazy_cost) * 100:.0f}-{max(lazy_cost) * 100:.0f}%, "
            f"{lazy_cost[3] * 100:.0f}% at 8 clients") in flat
    assert (f"(mean k {lazy[('osd-learning', 8)]['mean_k']:.2f} against {lazy[('osd', 8)]['mean_k']:.2f} at 8 clients in "
            f"that run, {by[('osd-learning', 8)]['mean_k']:.2f} against {by[('osd', 8)]['mean_k']:.2f} in this one)") in flat
    abba = {s: [x for x in result("bench-serve-vs-c4-abba.json")["records"] if x["server"] == s] for s in ("osd", "osd-target-only")}
    assert [x["concurrency"] for x in abba["osd"] + abba["osd-target-only"]] == [4] * 4
    ratio4 = sum(x["aggregate_tokens_per_s"] for x in abba["osd"]) / sum(x["aggregate_tokens_per_s"] for x in abba["osd-target-only"])
    acceptance4 = sum(x["acceptance_rate"] for x in abba["osd"]) / 2
    assert f"gave {ratio4:.2f}x target-only before the slot choice (`bench-serve-vs-c4-abba.json`, acceptance {acceptance4:.2f})" in flat
    sched = {(x["arm"], x["concurrency"]): x["tokens_per_s"] for x in result("bench-scheduler-prefix.json")["records"]}
    assert ("speculative / target-only " + " / ".join(f"{sched[('spec', c)] / sched[('target-only', c)]:.2f}x"
                                                       for c in (1, 2, 4, 8)) + " at 1 / 2 / 4 / 8 clients") in flat
    copy = {(x["server"], x["concurrency"]): x["aggregate_tokens_per_s"] for x in result("bench-serve-vs-copy.json")["records"]}
    x_llama = lambda rec, s: " / ".join(f"{rec[(s, c)] / rec[('llama-server', c)]:.2f}x" for c in levels)  # noqa: E731
    now = {k: x["aggregate_tokens_per_s"] for k, x in by.items()}
    assert (f"`bench-serve-vs-copy.json`: osd {x_llama(copy, 'osd')} llama-server, target-only "
            f"{x_llama(copy, 'osd-target-only')}, at 1 / 2 / 4 / 8 / 16 clients; in this run target-only "
            f"{x_llama(now, 'osd-target-only')})") in flat

    def reused(name):
        rows = {(x["arm"], x["concurrency"]): x["reused_rows"] for x in result(name)["records"]}
        return " / ".join(str(rows[("target-only", c)]) if rows[("target-only", c)] == rows[("spec", c)]
                          else f"{rows[('target-only', c)]} and {rows[('spec', c)]}" for c in (1, 2, 4, 8))
    assert (f"(reused prompt rows {reused('bench-scheduler-copy.json')} before, {reused('bench-scheduler-prefix.json')} "
            "after, at 1 / 2 / 4 / 8 clients)") in flat


def test_learnings_cost_in_the_alternating_runs_is_that_of_their_jsons():
    """Arms osd, learning, learning, osd at 8 clients: the cost against the mean of the osd arms."""
    flat = " ".join(README.split())

    def arms(name):
        tok = {"osd": [], "osd-learning": []}
        for r in result(name)["records"]:
            tok[r["server"]].append(r["aggregate_tokens_per_s"])
            assert r["concurrency"] == 8 and r.get("learner_optimizer_steps") in (None, 0)
        return tok

    cost = lambda t: 1 - sum(t["osd-learning"]) / sum(t["osd"])  # noqa: E731 (equal counts per arm)
    at_01, at_005 = arms("bench-serve-vs-learning-abba.json"), arms("bench-serve-vs-learning-abba-share005.json")
    after = arms("bench-serve-vs-learning-abba-teams.json")
    assert (f"after the fix {cost(after) * 100:.1f}%; before it {cost(at_01) * 100:.1f}% at the old busy share 0.1 and "
            f"{cost(at_005) * 100:.1f}% at 0.05") in flat


def test_the_native_llama_server_figures_are_those_of_bench_serve_vs_native():
    r = result("bench-serve-vs-native.json")
    flat = " ".join(README.split())
    by = {(x["server"], x["concurrency"]): x["aggregate_tokens_per_s"] for x in r["records"]}
    levels = r["config"]["levels"]
    native, portable = "llama-server-native", "llama-server"
    ratios = lambda a, b: " / ".join(f"{by[(a, c)] / by[(b, c)]:.2f}x" for c in levels)  # noqa: E731
    prefill = {p["server"]: p["prompt_tokens_per_s"] for p in r["prefill"]}
    same = [v for arm in r["identity"].values() for v in arm.values()]
    assert levels == [1, 2, 4, 8, 16] and {x["llama_build"] for x in r["records"] if x["server"] == native} == {"native"}
    assert f"`bench-serve-vs-native.json`, rev {r['git_revision']}, the same prompts" in flat
    assert (f"the native build served {ratios(native, portable)} the portable one's tokens/s at 1 / 2 / 4 / 8 / 16 "
            f"clients and prefilled the long prompt at {prefill[native]:.0f} prompt tokens/s against {prefill[portable]:.0f}") in flat
    assert (f"osd served {ratios('osd', native)} the native build ({ratios('osd', portable)} the portable one in this run) "
            f"and prefilled at {prefill['osd']:.0f} prompt tokens/s ({prefill['osd'] / prefill[native]:.2f}x the native "
            f"build); greedy identity {sum(v['same'] for v in same)} of {sum(v['of'] for v in same)}.") in flat
    short = {c: by[("osd", c)] / by[(native, c)] for c in levels if by[("osd", c)] / by[(native, c)] < (1.3 if c < 4 else 2.0)}
    assert sorted(short) == [1, 16] and (f"Against the native build 1 client ({short[1]:.2f}x, target 1.3x) and 16 "
                                         f"clients ({short[16]:.2f}x, target 2.0x) fall short") in flat
    assert by[("osd", 1)] / by[(portable, 1)] < 1.3 and "1 client was just short against the portable build too" in flat


def test_the_latest_serve_vs_run_is_that_of_bench_serve_vs_x16():
    r, by, tok = serve_vs("bench-serve-vs-x16.json")
    flat = " ".join(README.split())
    levels = r["config"]["levels"]
    native, portable = "llama-server-native", "llama-server"
    ratios = lambda a, b: " / ".join(f"{tok(a, c) / tok(b, c):.2f}x" for c in levels)  # noqa: E731
    p95 = lambda s: " / ".join(f"{by[(s, c)]['ttft_p95_s']:.2f}" for c in levels)  # noqa: E731
    goal = {1: 1.3, 2: 1.3, 4: 2.0, 8: 2.0, 16: 2.0}
    assert levels == [1, 2, 4, 8, 16] and f"(rev {r['git_revision']}, `bench-serve-vs-x16.json`" in flat
    assert (f"osd {ratios('osd', portable)} the portable llama-server and {ratios('osd', native)} the native build at "
            f"1 / 2 / 4 / 8 / 16 clients; target-only {ratios('osd-target-only', portable)} the portable build; with "
            f"learning {ratios('osd-learning', portable)}, learning's cost at 8 clients "
            f"{(1 - tok('osd-learning', 8) / tok('osd', 8)) * 100:.0f}%.") in flat
    assert all(tok("osd", c) / tok(portable, c) >= goal[c] for c in levels)  # "Every target met against the portable"
    assert [c for c in levels if tok("osd", c) / tok(native, c) < goal[c]] == [16]
    assert (f"all but 16 clients ({tok('osd', 16) / tok(native, 16):.2f}x, target 2.0x; target-only "
            f"{tok('osd-target-only', 16) / tok(native, 16):.2f}x)") in flat
    assert all(by[("osd", c)]["ttft_p95_s"] <= min(by[(s, c)]["ttft_p95_s"] for s in (native, portable)) for c in levels)
    assert f"TTFT p95 {p95('osd')} s against {p95(native)} (native) and {p95(portable)} (portable)" in flat
    prefill = {p["server"]: p["prompt_tokens_per_s"] for p in r["prefill"]}
    assert (f"1,063-token prompt {prefill['osd']:.0f} prompt tokens/s against {prefill[native]:.0f} and "
            f"{prefill[portable]:.0f}") in flat
    same = [v for arm in r["identity"].values() for v in arm.values()]
    assert all(v["same"] == v["of"] for v in same) and len(r["identity"]) == 2
    assert f"Greedy identity {sum(v['same'] for v in same) // 2} of {sum(v['of'] for v in same) // 2} per arm" in flat
    assert (f"Peak RSS at 16 clients {by[('osd', 16)]['peak_rss_bytes'] / 1e9:.2f} GB, learning on "
            f"{by[('osd-learning', 16)]['peak_rss_bytes'] / 1e9:.2f} GB") in flat
    assert by[("osd-learning", 16)]["peak_rss_bytes"] <= 6e9
    assert ("osd / target-only " + " / ".join(f"{tok('osd', c) / tok('osd-target-only', c):.2f}x" for c in levels)) in flat


def test_the_interleaved_kernel_and_its_amd_speed_are_those_of_their_runs():
    flat = " ".join(README.split())
    new, old = result("bench-kernel-x16.json")["model_pass"], result("bench-kernel.json")["model_pass"]
    ms, cost = new["ms"], new["cost_vs_one_row"]
    assert new["ms"][0] < old["ms"][0] and new["ms"][7] < old["ms"][7]
    assert (f"1 / 2 / 4 / 8 rows {ms[0]:.1f} / {ms[1]:.1f} / {ms[3]:.1f} / {ms[7]:.1f} ms with 2 threads, {cost[0]:.2f} / "
            f"{cost[1]:.2f} / {cost[3]:.2f} / {cost[7]:.2f}x one row (`benchmarks/bench-kernel-x16.json`; {old['ms'][0]:.1f} / "
            f"{old['ms'][1]:.1f} / {old['ms'][3]:.1f} / {old['ms'][7]:.1f} ms in `bench-kernel.json`") in flat
    avx2 = result("bench-kernel-cpu-avx2-x16.json")["model_pass"]["ms"]
    avx2_before = result("bench-kernel-cpu-avx2.json")["model_pass"]["ms"]
    worse = [a / b for a, b in zip(avx2[4:], avx2_before[4:])]
    assert f"5-8 rows cost {min(worse):.2f}-{max(worse):.2f}x what they did before" in flat
    speed = result("bench-speed-x16.json")
    dec, e2e = speed["decode_speedup_vs_baseline"], speed["end_to_end_speedup_vs_baseline"]
    assert (f"a fresh install decodes at {dec['osd_q4']:.2f}x llama.cpp ({e2e['osd_q4']:.2f}x end to end)** and osd's Q4 "
            f"target alone at {dec['osd_q4_target']:.2f}x") in flat
    assert speed["outputs_differing_from_osd_target"]["osd_q4"] == 0 and "AMD" in speed["machine"]["cpu"]


def test_the_repeated_amd_speed_run_is_that_of_its_json():
    speed = result("bench-speed-x16-repeat.json")
    dec, e2e = speed["decode_speedup_vs_baseline"], speed["end_to_end_speedup_vs_baseline"]
    assert speed["outputs_differing_from_osd_target"]["osd_q4"] == 0 and "AMD" in speed["machine"]["cpu"]
    assert (f"a second run (`bench-speed-x16-repeat.json`) gave {dec['osd_q4']:.2f}x ({e2e['osd_q4']:.2f}x end to end) "
            f"and {dec['osd_q4_target']:.2f}x.") in " ".join(README.split())


def test_the_intel_speed_run_on_the_interleaved_kernel_is_that_of_its_json():
    from osd_bench.speed import decode_speedup_by_domain

    speed = result("bench-speed-intel-x16.json")
    flat = " ".join(README.split())
    dec, e2e = speed["decode_speedup_vs_baseline"], speed["end_to_end_speedup_vs_baseline"]
    assert "Intel" in speed["machine"]["cpu"] and "amx_int8" in speed["machine"]["cpu_flags"]
    assert all(n == 0 for arm, n in speed["outputs_differing_from_osd_target"].items() if arm.startswith("osd_q4"))
    by_domain = {d: x["osd_q4"] for d, x in decode_speedup_by_domain(speed).items()}
    low, high = min(by_domain, key=by_domain.get), max(by_domain, key=by_domain.get)
    cal = speed["osd_q4_calibration"]
    assert (f"(AVX-512 VNNI, AMX; rev {speed['git_revision']}, `bench-speed-intel-x16.json`, with trees beside chains), "
            f"**a fresh install decodes at {dec['osd_q4']:.2f}x llama.cpp ({e2e['osd_q4']:.2f}x end to end)**, "
            f"{by_domain[low]:.2f}x ({low}) to {by_domain[high]:.2f}x ({high}) by domain, and osd's Q4 target alone at "
            f"{dec['osd_q4_target']:.2f}x; verifying 2 / 3 / 4 / 5 tokens costs "
            + " / ".join(f"{v:.2f}" for v in cal["verify_cost"][1:5]) + f"x one token and the draft c = {cal['c']:.3f}; "
            f"trees of up to 8 nodes {dec['osd_q4_tree']:.2f}x against the chains' {dec['osd_q4']:.2f}x") in flat
    tps = speed["decode_tokens_per_second"]["llama_cpp_target"]
    assert (f"(llama.cpp alone {tps:.1f} tokens/s against 16.2-16.6, osd's Q4 target one token "
            f"{cal['t_target'][0] * 1e3:.0f} ms)") in flat


def test_the_intel_multilingual_and_vnni_speed_sentences_are_those_of_their_runs():
    from osd_bench.speed import decode_speedup_by_domain

    flat = " ".join(README.split())
    ml, vnni = result("bench-speed-intel-multilingual.json"), result("bench-speed-intel-vnni.json")
    assert all("Intel" in r["machine"]["cpu"] for r in (ml, vnni))
    assert all(n == 0 for r in (ml, vnni) for arm, n in r["outputs_differing_from_osd_target"].items()
               if arm.startswith("osd_q4"))
    dec = ml["decode_speedup_vs_baseline"]
    by_domain = {d: x["osd_q4"] for d, x in decode_speedup_by_domain(ml).items()}
    assert set(by_domain) == {f"multilingual_qa@{lang}" for lang in ("de", "ru", "zh", "ar")}
    low, high = min(by_domain, key=by_domain.get), max(by_domain, key=by_domain.get)
    assert min(by_domain.values()) >= 1.0  # never slower than llama.cpp in any of the four languages
    assert (f"a fresh install decodes at {dec['osd_q4']:.2f}x llama.cpp, {by_domain[low]:.2f}x ({low}) to "
            f"{by_domain[high]:.2f}x ({high}), output identical on every prompt; most of it is the Q4 kernel "
            f"({dec['osd_q4_target']:.2f}x alone): speculation adds {dec['osd_q4'] / dec['osd_q4_target']:.2f}x there") in flat
    v = vnni["decode_speedup_vs_baseline"]
    assert f"(`bench-speed-intel-vnni.json`: {v['osd_q4_vnni']:.2f}x against {v['osd_q4']:.2f}x)" in flat
    assert v["osd_q4_vnni"] <= v["osd_q4"] * 1.05  # "level": not a gain that would make it the default


def test_the_multilingual_online_learning_figures_are_those_of_its_replay():
    r = result("replay-v3wide-multilingual-intel.json")
    flat = " ".join(README.split())
    langs = ("de", "ru", "zh", "ar")
    alpha = [r["end_of_stream_alpha_on_heldout"][f"multilingual_qa@{lang}"] for lang in langs]
    z = [r["heldout_vs_control"][f"multilingual_qa@{lang}"]["online"]["z"] for lang in langs]
    assert "Intel" in r["machine"]["cpu"] and r["config"]["per_segment"] == 75
    assert (" / ".join(f"{a['online']:.3f}" for a in alpha) + " (German / Russian / Chinese / Arabic) from "
            + " / ".join(f"{a['original']:.3f}" for a in alpha) + " never trained (z "
            + " / ".join(f"{v:.2f}" for v in z) + "): significant, and below 0.4 in every language") in flat
    assert all(v > 1.96 for v in z) and all(a["online"] < 0.4 for a in alpha)


def test_the_intel_learned_code_run_is_that_of_its_replay_and_speed_jsons():
    replay, speed = result("replay-v3-code300-intel.json"), result("bench-speed-intel-learned-code.json")
    flat = " ".join(README.split())
    alpha, z = replay["end_of_stream_alpha_on_heldout"]["code"], replay["heldout_vs_control"]["code"]
    gap = replay["heldout_online_vs_offline_100pct"]["code"]
    steps = replay["learner"]["optimizer_steps"]
    assert (f"held-out alpha {alpha['original']:.3f} for the never-trained draft, {alpha['online']:.3f} online, z "
            f"{z['online']['z']:.1f}; {alpha['offline_100pct']:.3f} for an offline draft given the same") in flat
    assert f"online {alpha['offline_100pct'] - alpha['online']:.3f} behind it, z {gap['z']:.2f})" in flat
    assert f"the same {steps} optimizer steps" in flat
    dec, e2e = speed["decode_speedup_vs_baseline"], speed["end_to_end_speedup_vs_baseline"]
    fresh, learned = speed["osd_q4_spec_stats"], speed["osd_q4_learned"]["spec_stats"]
    assert speed["config"]["offset"] >= replay["config"]["per_segment"] + replay["config"]["heldout"]  # never seen
    assert all(n == 0 for arm, n in speed["outputs_differing_from_osd_target"].items() if arm.startswith("osd_q4"))
    assert (f"**{dec['osd_q4_learned']:.2f}x llama.cpp ({e2e['osd_q4_learned']:.2f}x end to end)**, against "
            f"{dec['osd_q4']:.2f}x for the never-trained draft in the same run and {dec['osd_q4_target']:.2f}x for osd's "
            f"Q4 target alone (`bench-speed-intel-learned-code.json`: alpha {fresh['alpha']:.3f} -> "
            f"{learned['alpha']:.3f}, tokens per step {fresh['tokens_per_step']:.2f} -> "
            f"{learned['tokens_per_step']:.2f};") in flat


def test_the_intel_serve_vs_run_is_that_of_bench_serve_vs_intel():
    r, by, tok = serve_vs("bench-serve-vs-intel.json")
    flat = " ".join(README.split())
    levels, portable = r["config"]["levels"], "llama-server"
    ratios = lambda a: " / ".join(f"{tok(a, c) / tok(portable, c):.2f}x" for c in levels)  # noqa: E731
    p95 = lambda s: " / ".join(f"{by[(s, c)]['ttft_p95_s']:.2f}" for c in levels)  # noqa: E731
    cost = {c: (1 - tok("osd-learning", c) / tok("osd", c)) * 100 for c in levels}
    goal = {1: 1.3, 2: 1.3, 4: 2.0, 8: 2.0, 16: 2.0}
    assert "Intel" in result("bench-speed-intel-x16.json")["machine"]["cpu"] and levels == [1, 2, 4, 8, 16]
    assert f"(AVX-512 VNNI, AMX; rev {r['git_revision']}, `bench-serve-vs-intel.json`" in flat
    assert (f"osd {ratios('osd')} the portable llama-server at 1 / 2 / 4 / 8 / 16 clients; target-only "
            f"{ratios('osd-target-only')}; with learning {ratios('osd-learning')}. Every serving target met") in flat
    assert all(tok("osd", c) / tok(portable, c) >= goal[c] for c in levels)
    assert (f"learning's cost at 8 clients {cost[8]:.0f}% (target 10%: missed; "
            + " / ".join(f"{cost[c]:.0f}%" for c in levels) + " at 1 / 2 / 4 / 8 / 16 clients, with "
            f"{sum(by[('osd-learning', c)]['learner_optimizer_steps'] or 0 for c in levels)} optimizer step") in flat
    assert cost[8] > 10
    prefill = {p["server"]: p["prompt_tokens_per_s"] for p in r["prefill"]}
    amd = {p["server"]: p["prompt_tokens_per_s"] for p in result("bench-serve-vs-x16.json")["prefill"]}
    assert (f"prefilled at {prefill['osd-learning']:.0f} prompt tokens/s against {prefill['osd']:.0f}, where on AMD the "
            f"two were level, {amd['osd-learning']:.0f} and {amd['osd']:.0f}") in flat
    paired = result("bench-serve-learning-paired-intel.json")
    ratio, (low, high) = paired["tokens_per_second_ratio"]["ratio"], paired["tokens_per_second_ratio"]["ci95"]
    assert "Intel" in paired["machine"]["cpu"] and paired["config"]["concurrency"] == 8 and paired["config"]["rounds"] == 6
    assert (f"(`bench-serve-learning-paired-intel.json`, 8 clients, 6 round pairs): {(1 - ratio) * 100:.1f}% (tokens/s "
            f"ratio {ratio:.3f}, 95% interval {low:.3f}-{high:.3f}), inside the target") in flat
    assert 1 - ratio <= 0.10
    assert all(by[("osd", c)]["ttft_p95_s"] <= by[(portable, c)]["ttft_p95_s"] for c in levels)
    assert f"TTFT p95 {p95('osd')} s against {p95(portable)}." in flat
    assert f"1,063-token prompt {prefill['osd']:.0f} prompt tokens/s against {prefill[portable]:.0f}." in flat
    same = [v for arm in r["identity"].values() for v in arm.values()]
    assert all(v["same"] == v["of"] for v in same) and sum(v["of"] for v in same) == 160
    assert (f"Peak RSS at 16 clients {by[('osd', 16)]['peak_rss_bytes'] / 1e9:.2f} GB, learning on "
            f"{by[('osd-learning', 16)]['peak_rss_bytes'] / 1e9:.2f} GB.") in flat
    (failed,) = r["failed_arms"]
    assert failed["server"] == "llama-server-native" and "SIGILL" in failed["error"]
    assert not any(x["server"] == "llama-server-native" for x in r["records"])


def test_the_multilingual_feature_head_figures_are_those_of_its_run():
    r = result("feature-head-multilingual.json")
    a, z = r["first_proposal_agreement"], r["head_vs_draft"]["z"]
    assert all(name.startswith("multilingual_qa@") for name, *_ in r["config"]["train_slices"] + r["config"]["heldout_slices"])
    assert (f"the head agrees {a['feature_head']:.3f} of the time against the never-trained widened draft's "
            f"{a['cheap_draft']:.3f} (z {z:.2f})") in " ".join(README.split())


def test_the_feature_head_chain_figures_are_those_of_its_run():
    r = result("feature-head-chains.json")
    a, acc, vs = r["first_proposal_agreement"], r["accepted_by_depth"], r["accepted_head_vs_draft"]
    assert r["config"]["depth"] == 4 and r["config"]["feature_weight"] > 0  # the chain reads predicted features
    flat = " ".join(README.split())
    assert (f"it is ahead on the first proposal, {a['feature_head']:.3f} against the draft's {a['cheap_draft']:.3f} "
            f"(z {r['head_vs_draft']['z']:.2f}), but a chain of 4 accepts {acc['feature_head'][3]:.3f} proposals per "
            f"step against the draft's {acc['cheap_draft'][3]:.3f} (paired by start, z {vs['z']:.2f})") in flat
    assert acc["feature_head"][3] < acc["cheap_draft"][3] and vs["z"] < -1.96  # "loses" is significant


def test_the_multilingual_depth_figures_are_those_of_their_runs():
    flat = " ".join(README.split())
    runs = [result("bench-speed-intel-multilingual-depth-repeat.json"), result("bench-speed-intel-multilingual-depth.json")]
    for speed in runs:
        config = speed["config"]
        assert config["models"]["draft"] == "bundled:qwen2.5-coder-0.5b" and config["learned_draft"] == "derived:cheap-0.5b-v3"
    x, c = runs[0]["decode_speedup_vs_baseline"], runs[0]["osd_q4_calibration"]["c"]
    assert (f"its token costs {c:.2f} target tokens on the Q4 kernel, so on the same 24 questions the k policy stops "
            f"proposing from it and the arm runs on the n-gram lookup, {x['osd_q4']:.2f}x llama.cpp against the cheap "
            f"draft's {x['osd_q4_learned']:.2f}x and the Q4 target alone's {x['osd_q4_target']:.2f}x") in flat
    x, c = runs[1]["decode_speedup_vs_baseline"], runs[1]["osd_q4_calibration"]["c"]
    assert f"(c {c:.2f}), it was used and decoded at {x['osd_q4']:.2f}x, below the Q4 target alone" in flat
    assert x["osd_q4"] < x["osd_q4_target"]
    alphas = {name: [result(f"eval-multilingual-depth-{lang}.json")["drafts"][name]["alpha_greedy"]
                     for lang in ("de", "ru", "zh", "ar")] for name in ("bundled:qwen2.5-coder-0.5b", "derived:cheap-0.5b-v3")}
    deep, cheap = alphas["bundled:qwen2.5-coder-0.5b"], alphas["derived:cheap-0.5b-v3"]
    assert (f"teacher-forced alpha {min(deep):.2f}-{max(deep):.2f} in each language against the cheap draft's "
            f"{min(cheap):.2f}-{max(cheap):.2f}") in flat


def test_the_mixed_chain_figures_are_those_of_its_run():
    r = result("feature-head-chains-mixed.json")
    acc, mixed, s = r["accepted_by_depth"], r["accepted_head_then_draft_vs_draft"], r["seconds_per_token_fp32"]
    assert (f"it adds {mixed['mean_difference']:.3f} accepted proposals per step ({acc['head_then_draft'][3]:.3f} against "
            f"{acc['cheap_draft'][3]:.3f}, z {mixed['z']:.2f}") in " ".join(README.split())
    assert f"for a forward that costs {s['feature_head'] / s['target_q4']:.2f} of a target token in fp32" in README
    # the repeat reproduces the chain run it extends (same answers, same seeded training)
    assert acc["feature_head"] == result("feature-head-chains.json")["accepted_by_depth"]["feature_head"]


def over_q4_target(name: str) -> float:
    """osd_q4's decode speed as a multiple of the Q4 target alone's, in the same `osd bench speed` run."""
    speedup = result(name)["decode_speedup_vs_baseline"]
    return speedup["osd_q4"] / speedup["osd_q4_target"]


def test_the_busy_calibration_figures_are_those_of_their_runs():
    flat = " ".join(README.split())
    before6, after6 = (over_q4_target(f"bench-speed-intel-busy6-calibration{tail}.json") for tail in ("-before", ""))
    before2, after2 = (over_q4_target(f"bench-speed-intel-busy-calibration{tail}.json") for tail in ("-before", ""))
    quiet = over_q4_target("bench-speed-intel-multilingual-depth-repeat.json")
    assert f"decoded at {before6:.2f}x the Q4 target alone" in flat
    assert f"this one at {after6:.2f}x" in flat and f"{quiet:.2f}x with a quiet calibration" in flat
    assert f"stopped speculating altogether ({before2:.2f}x) and this one reached {after2:.2f}x" in flat
    for name in ("bench-speed-intel-busy6-calibration-before.json", "bench-speed-intel-busy6-calibration.json"):
        assert result(name)["config"]["busy_calibration"] == 6
    assert result("bench-speed-intel-busy-calibration-before.json")["osd_q4_spec_stats"]["proposed"] <= 2


def test_the_probe_catch_up_figures_are_those_of_their_runs():
    flat = " ".join(README.split())
    before, after = "bench-speed-intel-probe-catch-up-before.json", "bench-speed-intel-probe-catch-up.json"
    seconds = lambda name: result(name)["osd_q4_spec_stats"]["draft_seconds"]
    assert f"forwards took {seconds(before):.2f} s of a 24-question run before and {seconds(after):.3f} s after" in flat
    assert f"({over_q4_target(before):.2f}x and {over_q4_target(after):.2f}x the Q4 target alone" in flat


def test_the_q4_draft_figures_are_those_of_their_runs():
    from osd_bench.speed import decode_speedup_by_domain

    flat = " ".join(README.split())
    runs = result("bench-speed-intel-q4draft.json"), result("bench-speed-intel-multilingual-q4draft.json")
    for r in runs:
        assert "Intel" in r["machine"]["cpu"] and len(r["config"]["prompts"]) == 24
        assert r["config"]["models"]["draft"] == "bundled:qwen2.5-coder-0.5b"
        assert r["config"]["learned_draft"] == "derived:cheap-0.5b-v3"
        assert all(n == 0 for arm, n in r["outputs_differing_from_osd_target"].items() if arm.startswith("osd_q4"))
    r, ml = runs
    dec, e2e, q = r["decode_speedup_vs_baseline"], r["end_to_end_speedup_vs_baseline"], r["osd_q4_q4draft"]
    assert (f"costs c = {q['calibration']['c']:.3f} of a target token against {r['osd_q4_calibration']['c']:.3f} for "
            f"its int8 copy") in flat
    assert (f"It decodes at **{dec['osd_q4_q4draft']:.2f}x llama.cpp ({e2e['osd_q4_q4draft']:.2f}x end to end)**, "
            f"against {dec['osd_q4_learned']:.2f}x for the shipped cheap draft never trained (`derived:cheap-0.5b-v3`) "
            f"and {dec['osd_q4']:.2f}x for the same 0.5B's int8 copy") in flat
    by_domain = decode_speedup_by_domain(r)
    assert all(x["osd_q4_q4draft"] > x["osd_q4_learned"] for x in by_domain.values())  # "ahead ... in every domain"
    assert ", ".join(f"{d} {x['osd_q4_q4draft']:.2f}x against {x['osd_q4_learned']:.2f}x"
                     for d, x in by_domain.items()) in flat
    s = q["spec_stats"]
    assert f"alpha {s['alpha']:.3f}, {s['tokens_per_step']:.2f} tokens per step, output identical" in flat
    m, mdec = ml["osd_q4_q4draft"]["spec_stats"], ml["decode_speedup_vs_baseline"]
    assert (f"it drafts at alpha {m['alpha']:.3f} and {m['tokens_per_step']:.2f} tokens per step, yet decodes level with "
            f"the lookup alone ({mdec['osd_q4_q4draft']:.2f}x against {mdec['osd_q4']:.2f}x)") in flat
    assert abs(mdec["osd_q4_q4draft"] / mdec["osd_q4"] - 1) < 0.03  # "level"
    mc = ml["osd_q4_q4draft"]["calibration"]["c"]
    assert f"costs {mc:.2f} of a target token and drafts there at live alpha {m['alpha']:.2f}, level with" in flat


def multilingual_heldout(name: str, draft: str):
    """A multilingual `osd replay --fast` result (Intel, of `draft`) -> its held-out figures as the README writes them
    (de / ru / zh / ar: never trained, online, z of online against never trained) and, by language, {"online": alpha,
    "z": z}."""
    r = result(name)
    assert "Intel" in r["machine"]["cpu"] and r["config"]["models"]["draft"] == draft
    langs = [f"multilingual_qa@{lang}" for lang in ("de", "ru", "zh", "ar")]
    alpha, vs = r["end_of_stream_alpha_on_heldout"], r["heldout_vs_control"]
    joined = lambda values: " / ".join(values)
    return (joined(f"{alpha[d]['original']:.3f}" for d in langs), joined(f"{alpha[d]['online']:.3f}" for d in langs),
            joined(f"{vs[d]['online']['z']:.2f}" for d in langs),
            {d: {"online": alpha[d]["online"], "z": vs[d]["online"]["z"]} for d in langs})


def test_the_whole_draft_multilingual_replay_figures_are_those_of_its_run():
    never, online, z, heldout = multilingual_heldout("replay-05b-multilingual-intel.json", "bundled:qwen2.5-coder-0.5b")
    flat = " ".join(README.split())
    assert f"{never} never trained, {online} online (z {z}), within noise or slightly below" in flat
    assert all(abs(h["z"]) < 1.96 for h in heldout.values())  # "within noise"


def test_the_healed_multilingual_cut_figures_are_those_of_its_runs():
    never, online, z, heldout = multilingual_heldout("replay-ml7-multilingual-intel.json", "derived:/work/runs/s11/ml7")
    flat = " ".join(README.split())
    assert f"starts at held-out {never} on the widened draft's replay stream and learns online to {online} (z {z}, " in flat
    assert [d for d, h in heldout.items() if h["online"] >= 0.4] == ["multilingual_qa@ru"]  # "0.4 in Russian only"
    heal = result("heal-ml7-multilingual.json")
    assert heal["samples"] == 400 and f"{heal['seconds'] / 60:.1f} min here" in flat
    speed = result("bench-speed-intel-multilingual-ml7.json")
    dec = speed["decode_speedup_vs_baseline"]
    assert f"it decodes level with it, {dec['osd_q4']:.2f}x against {dec['osd_q4_learned']:.2f}x llama.cpp" in flat
    assert abs(dec["osd_q4"] / dec["osd_q4_learned"] - 1) < 0.03  # "level"
    c_cut, c_cheap = speed["osd_q4_calibration"]["c"], speed["osd_q4_learned"]["calibration"]["c"]
    assert f"costs {c_cut:.3f} of a target token against the shipped draft's {c_cheap:.3f}" in flat


def test_the_closed_loop_q4_draft_figures_are_those_of_bench_scheduler():
    r = result("bench-scheduler-q4draft-intel.json")
    by = {(x["arm"], x["concurrency"]): x["tokens_per_s"] for x in r["records"]}
    q4, cheap = by[("spec-q4", 1)] / by[("target-only", 1)], by[("spec", 1)] / by[("target-only", 1)]
    assert q4 < cheap  # "its lead is a decode lead"
    flat = " ".join(README.split())
    assert f"it served {q4:.2f}x target-only against the cheap draft's {cheap:.2f}x" in flat


def test_the_shipped_drafts_q4_copy_figures_are_those_of_its_run():
    """The default copy became `auto` (the Q4 copy) on this run: both copies of the shipped draft, one run."""
    from osd_bench.speed import decode_speedup_by_domain

    r = result("bench-speed-intel-cheap-q4copy.json")
    assert "Intel" in r["machine"]["cpu"] and len(r["config"]["prompts"]) == 24
    assert r["config"]["models"]["draft"] == "derived:cheap-0.5b-v3" and r["config"]["models"]["draft_quantize"] == "int8"
    assert all(n == 0 for arm, n in r["outputs_differing_from_osd_target"].items() if arm.startswith("osd_q4"))
    dec, e2e, q = r["decode_speedup_vs_baseline"], r["end_to_end_speedup_vs_baseline"], r["osd_q4_q4draft"]
    flat = " ".join(README.split())
    assert (f"c = {q['calibration']['c']:.3f} of a target token against {r['osd_q4_calibration']['c']:.3f} for its int8 "
            f"copy, alpha {q['spec_stats']['alpha']:.3f} against {r['osd_q4_spec_stats']['alpha']:.3f}, decoding at "
            f"**{dec['osd_q4_q4draft']:.2f}x llama.cpp against {dec['osd_q4']:.2f}x ({e2e['osd_q4_q4draft']:.2f}x "
            f"against {e2e['osd_q4']:.2f}x end to end)**, ahead or level in every domain") in flat
    assert all(x["osd_q4_q4draft"] >= x["osd_q4"] for x in decode_speedup_by_domain(r).values())


def test_the_draft_prefix_reuse_figures_are_those_of_bench_scheduler():
    r = result("bench-scheduler-draft-prefix-intel.json")
    assert "Intel" in r["machine"]["cpu"]
    by = {(x["arm"], x["concurrency"]): x for x in r["records"]}
    t = by[("target-only", 1)]["tokens_per_s"]
    reuse, fresh, cheap = (by[(a, 1)]["tokens_per_s"] / t for a in ("spec-q4", "spec-q4-fresh", "spec"))
    assert by[("spec-q4", 1)]["draft_reused_rows"] > 0 == by[("spec-q4-fresh", 1)]["draft_reused_rows"]
    flat = " ".join(README.split())
    assert (f"the whole 0.5B's arm served {reuse:.3f}x target-only against {fresh:.3f}x for the same arm feeding every "
            f"prompt whole, level with the cheap draft's {cheap:.3f}x") in flat
    assert reuse > fresh and abs(reuse / cheap - 1) < 0.03  # "level"


def test_the_fresh_auto_figures_are_those_of_its_run():
    from osd_bench.speed import decode_speedup_by_domain

    r = result("bench-speed-intel-fresh-auto.json")
    assert "Intel" in r["machine"]["cpu"] and len(r["config"]["prompts"]) == 24
    assert r["config"]["models"]["draft_quantize"] == "auto" and r["draft_copy"]["chosen"] == "q4"
    assert all(n == 0 for arm, n in r["outputs_differing_from_osd_target"].items() if arm.startswith("osd"))
    dec, e2e, sec = r["decode_speedup_vs_baseline"], r["end_to_end_speedup_vs_baseline"], r["draft_copy"]["seconds_per_token"]
    by = {d: x["osd_q4"] for d, x in decode_speedup_by_domain(r).items()}
    lo, hi = min(by, key=by.get), max(by, key=by.get)
    flat = " ".join(README.split())
    assert (f"a fresh install decodes at **{dec['osd_q4']:.2f}x llama.cpp ({e2e['osd_q4']:.2f}x end to end)**, "
            f"{by[lo]:.2f}x ({lo}) to {by[hi]:.2f}x ({hi}) by domain") in flat
    assert f"({sec['q4'] * 1e3:.2f} ms against {sec['int8'] * 1e3:.2f} ms a draft token for int8)" in flat
    assert sec["q4"] < sec["int8"] and min(by.values()) >= 1.0 and dec["osd_q4"] >= 1.5


def test_the_intel_serve_vs_run_at_the_current_defaults_is_that_of_its_json():
    r, by, tok = serve_vs("bench-serve-vs-intel-auto.json")
    flat = " ".join(README.split())
    levels = r["config"]["levels"]
    ratios = lambda a, b="llama-server": " / ".join(f"{tok(a, c) / tok(b, c):.2f}x" for c in levels)  # noqa: E731
    cost = [(1 - tok("osd-learning", c) / tok("osd", c)) * 100 for c in levels]
    assert "Intel" in r["machine"]["cpu"] and levels == [1, 2, 4, 8, 16]
    assert f"(rev {r['git_revision']}, `bench-serve-vs-intel-auto.json`" in flat
    assert (f"osd {ratios('osd')} the portable llama-server at 1 / 2 / 4 / 8 / 16 clients; target-only "
            f"{ratios('osd-target-only')}; with learning {ratios('osd-learning')}: **learning's cost at 8 clients "
            f"{cost[3]:.0f}%**, inside the target this time (" + " / ".join(f"{x:.0f}%" for x in cost)) in flat
    assert cost[3] <= 10
    spec = [tok("osd", c) / tok("osd-target-only", c) for c in levels]
    assert (f"Speculation against osd target-only {spec[0]:.2f}x / {spec[1]:.2f}x alone and at 2 clients, "
            f"{spec[2]:.2f}x / {spec[3]:.2f}x / {spec[4]:.2f}x from 4 on") in flat
    pooled = [next(p for p in result(name)["pooled"] if p["arm"] == "spec")["x_target_only"]
              for name in ("bench-scheduler-c4-pooled-intel.json", "bench-scheduler-c4-pooled-intel-first.json")]
    assert f"paired repeats at 4 in flight: {pooled[0]:.3f}x and, in another run, {pooled[1]:.3f}x" in flat
    prefill = {p["server"]: p["prompt_tokens_per_s"] for p in r["prefill"]}
    assert f"Prefill of the 1,063-token prompt {prefill['osd']:.0f} prompt tokens/s against {prefill['llama-server']:.0f}." in flat
    same = [v for arm in r["identity"].values() for v in arm.values()]
    assert all(v["same"] == v["of"] for v in same) and sum(v["of"] for v in same) == 160


def test_the_q4_payload_is_that_of_bench_scale_q4():
    r = result("bench-scale-q4-intel.json")
    (record,) = r["records"]
    assert record["learner"]["draft_copy"] == "q4" and set(record["draft_copies"]) == {"q4"}
    assert (f"gate|up matrices are fused: {record['publish']['payload_bytes'] / 1e6:.1f} MB for the shipped draft, "
            "`bench-scale-q4-intel.json`, where the learner timed and chose the Q4 copy for every replica)") in " ".join(
        README.split())
