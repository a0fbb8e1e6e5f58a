"""README figures recomputed from the JSON results that back them: a figure that drifts from its file fails here."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def result(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / name).read_text())


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


def test_the_serve_vs_table_is_that_of_bench_serve_vs():
    r = result("bench-serve-vs.json")
    by = {(x["server"], x["concurrency"]): x for x in r["records"]}
    tok = lambda server, c: by[(server, c)]["aggregate_tokens_per_s"]  # noqa: E731
    for c in r["config"]["levels"]:
        base = tok("llama-server", c)
        cells = [f"{base:.1f}"] + [f"{tok(s, c):.1f} ({tok(s, c) / base:.2f}x)" for s in ("osd", "osd-learning",
                                                                                        "osd-target-only")]
        cells += [f"{by[('llama-server', c)]['ttft_p95_s']:.2f} / {by[('osd', c)]['ttft_p95_s']:.2f} s",
                  f"{by[('osd', c)]['peak_rss_bytes'] / 1e9:.2f} GB"]
        assert f"| {c} | " + " | ".join(cells) + " |" in README, c
    prefill = {p["server"]: p for p in r["prefill"]}
    osd, llama = prefill["osd"]["prompt_tokens_per_s"], prefill["llama-server"]["prompt_tokens_per_s"]
    assert (f"Prefill of one {prefill['osd']['prompt_tokens']:,}-token prompt alone: osd {osd:.0f} prompt tokens/s, "
            f"llama-server {llama:.0f} ({osd / llama:.2f}x") in README.replace("\n", " ")


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


def test_the_feature_head_figures_are_those_of_its_run():
    r = result("feature-head.json")
    a = r["first_proposal_agreement"]
    flat = " ".join(README.split())
    assert (f"agrees with the target's first token after a step {a['feature_head']:.3f} of the time on "
            f"{r['heldout_positions']:,} held-out positions, the shipped `cheap-0.5b-v3` {a['cheap_draft']:.3f}") in flat
