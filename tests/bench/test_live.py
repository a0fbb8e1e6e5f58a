"""`osd bench live` (osd_bench/live.py): the arrival schedule, the per-window figures and the on/off comparison, and
a short end-to-end run of both arms on the tiny pair (real `osd serve` processes)."""
import asyncio
import json

import httpx
import pytest

from osd_bench import live
from osd_bench.live import (LiveConfig, append_block, arrival_schedule, block_arrivals, block_order, compare,
                           first_publish, run_live, windows)


def test_the_arrival_schedule_is_reproducible_from_its_seed():
    a, b = arrival_schedule(500, 2.0, seed=7), arrival_schedule(500, 2.0, seed=7)
    assert a == b and a != arrival_schedule(500, 2.0, seed=8)
    assert all(x < y for x, y in zip(a, a[1:])) and a[0] > 0
    assert a[-1] / 500 == pytest.approx(0.5, rel=0.15)  # mean gap 1 / rate
    assert arrival_schedule(500, 4.0, seed=7) == pytest.approx([t / 2 for t in a])  # the rate only scales time


def _rows(tps: list[float], texts=None, version_from=None):
    rows = []
    for i, v in enumerate(tps):
        rows.append({"index": i, "arrival": float(i), "sent": float(i), "done": i + 1.0, "ok": True, "error": None,
                     "ttft": 0.1, "seconds": 1.0, "completion_tokens": 10, "decode_tps": v,
                     "text": (texts or {}).get(i, f"answer {i}"), "accepted": 4, "proposed": 8, "steps": 5,
                     "tokens_per_step": 2.0, "draft_version": int(version_from is not None and i >= version_from)})
    return rows


def test_windows_the_headline_ratios_and_greedy_identity():
    scrapes = [{"t": 0.0, "optimizer_steps": 0, "published": 0, "learner_busy_seconds": 0.0,
                "learner_idle_seconds": 0.0, "serving_seconds": 0.0, "passes": 0, "rows": 0, "step_seconds": 0.0,
                "draft_seconds": 0.0, "prompt_rows": 0, "decode_seconds": 0.0, "speculable_seconds": 0.0},
               {"t": 8.0, "optimizer_steps": 16, "published": 1, "learner_busy_seconds": 0.8,
                "learner_idle_seconds": 0.0, "serving_seconds": 7.2, "passes": 80, "rows": 240, "step_seconds": 6.4,
                "draft_seconds": 0.4, "prompt_rows": 96, "decode_seconds": 6.0, "speculable_seconds": 4.5}]
    on_rows = _rows([9.0] * 4 + [12.0] * 4, texts={7: "different"}, version_from=4)
    off_rows = _rows([10.0] * 8)
    on = {"rows": on_rows, "scrapes": scrapes, "windows": windows(on_rows, scrapes, 4)}
    off = {"rows": off_rows, "scrapes": [], "windows": windows(off_rows, [], 4)}
    w = on["windows"][0]
    assert w["requests"] == 4 and w["decode_tps_mean"] == 9.0 and w["acceptance"] == 0.5 and w["mean_k"] == 1.6
    assert w["tokens_per_step"] == 2.0 and w["optimizer_steps"] == pytest.approx(8.0)  # 0-4 s of the 0-8 s scrapes
    assert w["learner_cpu_share"] == pytest.approx(0.1) and w["learner_busy_share"] == pytest.approx(0.1)
    assert w["rows_per_pass"] == pytest.approx(3.0) and w["pass_ms"] == pytest.approx(80.0)
    assert w["prompt_rows_per_pass"] == pytest.approx(1.2)  # 96 of the 240 rows were prompt rows
    assert w["draft_share"] == pytest.approx(0.05)  # 0.2 s of drafting over the window's 4 s
    assert w["speculable_share"] == pytest.approx(0.75)  # 4.5 of the 6 s of decoding passes had no prompt rows
    assert off["windows"][0]["optimizer_steps"] is None  # no learner series scraped
    assert off["windows"][0]["pass_ms"] is None
    c = compare(on, off, 4)
    assert [x["decode_tps_ratio"] for x in c["windows"]] == pytest.approx([0.9, 1.2])
    assert c["first_quarter_ratio"] == pytest.approx(0.9) and c["last_quarter_ratio"] == pytest.approx(1.2)
    assert c["min_ratio_after_first_window"] == pytest.approx(1.2)
    assert c["greedy_identical"] == {"same": 7, "of": 8}
    pub = first_publish(on_rows, scrapes)
    assert pub["seconds"] == 8.0 and pub["requests_arrived"] == 8 and pub["first_request_served_by_a_new_version"] == 4


def test_a_scrape_sums_a_labelled_series_over_its_labels():
    from osd_bench.live import scrape

    text = ('osd_spec_draft_seconds_total{draft="default",draft_version="0"} 1.5\n'
            'osd_spec_draft_seconds_total{draft="default",draft_version="1"} 2.0\n'
            'osd_schedule_steps_total 40.0\nosd_learner_version 1.0\n'
            '# TYPE osd_learner_work_seconds_train counter\nosd_learner_work_seconds_train_total 3.25\n'
            'osd_learner_work_seconds_total 9.0\nosd_other_total 1.0\n')

    class Client:
        async def get(self, path):
            return httpx.Response(200, text=text, request=httpx.Request("GET", "http://x" + path))

    out = asyncio.run(scrape(Client()))
    assert out == {"draft_seconds": 3.5, "passes": 40.0, "version": 1.0, "work_train": 3.25}


def test_every_update_phase_of_the_learner_has_its_scraped_series():
    from osd.learn.online import UPDATE_PHASES
    from osd_bench.live import series_of_phase

    assert [series_of_phase(f"osd_learner_work_seconds_{p}_total") for p in UPDATE_PHASES] == \
        [f"work_{p}" for p in UPDATE_PHASES]
    assert series_of_phase("osd_learner_optimizer_steps_total") is None


def test_the_cli_registers_live():
    from osd.cli import build_parser

    args = build_parser().parse_args(["bench", "live", "--stream", "my.jsonl", "--load", "0.5", "0.8",
                                      "--requests", "40", "--capacity", "1.5"])
    assert (args.stream, args.load, args.requests, args.capacity) == ("my.jsonl", [0.5, 0.8], 40, 1.5)


def test_both_arms_on_the_tiny_pair_answer_identically_and_report_windows(tmp_path):
    from osd_bench.live_report import report_live

    stream = tmp_path / "stream.jsonl"
    prompts = ["def add(a, b):", "Sort a list.", "Hello there", "x = 1\ny =", "for i in range(", "print('hi')"]
    stream.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    config = LiveConfig(models="tiny", stream=str(stream), requests=6, loads=(0.5,), capacity=4.0, window=3,
                        max_tokens=24, scrape_every=0.5, osd_args=("--threads", "1"),
                        learn_args=("--every-requests", "2", "--busy-share", "0.5"))
    result = run_live(config, str(tmp_path / "logs"), progress=lambda *_: None)
    entry = result["loads"][0]
    assert entry["arrivals"] == arrival_schedule(6, 2.0, 0)
    on, off = entry["arms"]["on"], entry["arms"]["off"]
    assert all(r["ok"] for r in on["rows"] + off["rows"])
    assert len(on["windows"]) == len(off["windows"]) == 2
    assert entry["comparison"]["greedy_identical"] == {"same": 6, "of": 6}
    assert "--no-learn" in off["server_command"] and "--no-learn" not in on["server_command"]
    assert any("optimizer_steps" in s for s in on["scrapes"])  # the learner's series were scraped
    out = tmp_path / "live.json"
    report_live(result, str(out), None)
    assert json.loads(out.read_text())["loads"][0]["comparison"]["greedy_identical"]["of"] == 6


def test_interleaved_blocks_keep_their_gaps_and_each_arm_its_own_clock():
    arrivals = [1.0, 2.0, 4.0, 7.0, 11.0]
    assert block_arrivals(arrivals, 0, 2) == [1.0, 2.0] and block_arrivals(arrivals, 2, 4) == [2.0, 5.0]
    assert [block_order(b) for b in range(3)] == [("off", "on"), ("on", "off"), ("off", "on")]
    arm = {"rows": [], "scrapes": [], "wall_seconds": 0.0}
    row = {"index": 0, "arrival": 1.0, "sent": 1.0, "done": 3.0, "text": "a"}
    append_block(arm, {"rows": [row], "scrapes": [{"t": 0.0, "optimizer_steps": 0}], "wall_seconds": 5.0}, 0)
    append_block(arm, {"rows": [row], "scrapes": [{"t": 4.0, "optimizer_steps": 8}], "wall_seconds": 6.0}, 1)
    assert [(r["index"], r["arrival"], r["done"]) for r in arm["rows"]] == [(0, 1.0, 3.0), (1, 6.0, 8.0)]
    assert [s["t"] for s in arm["scrapes"]] == [0.0, 9.0] and arm["wall_seconds"] == 11.0


def test_interleaved_arms_answer_identically_and_the_learner_rests_while_the_other_serves(tmp_path, monkeypatch):
    stream = tmp_path / "stream.jsonl"
    prompts = ["def add(a, b):", "Sort a list.", "Hello there", "x = 1\ny =", "for i in range(", "print('hi')"]
    stream.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    paused, real = [], live.set_learner_paused
    monkeypatch.setattr(live, "set_learner_paused", lambda server, p: paused.append(p) or real(server, p))
    config = LiveConfig(models="tiny", stream=str(stream), requests=6, loads=(0.5,), capacity=4.0, window=3,
                        max_tokens=24, scrape_every=0.5, osd_args=("--threads", "1"),
                        learn_args=("--every-requests", "2", "--busy-share", "0.5"), interleave=3,
                        same_calibration=True)
    entry = run_live(config, str(tmp_path / "logs"), progress=lambda *_: None)["loads"][0]
    on, off = entry["arms"]["on"], entry["arms"]["off"]
    assert paused == [True, False, False, True, False]  # block 0: off then on; block 1: on then off; then resumed
    # one measurement of the costs for both: the off server's, read by the on server
    assert off["calibration"].endswith("(measured)") and on["calibration"].endswith("calibration-load0.5.json)")
    assert on["calibration"].rsplit(" (", 1)[0] == off["calibration"].rsplit(" (", 1)[0]
    assert [r["index"] for r in on["rows"]] == [r["index"] for r in off["rows"]] == list(range(6))
    assert all(r["ok"] for r in on["rows"] + off["rows"]) and len(on["windows"]) == 2
    assert entry["comparison"]["greedy_identical"] == {"same": 6, "of": 6}
    assert on["rows"][3]["arrival"] >= on["rows"][2]["done"] - 1e-6  # block 1 starts once block 0 drained
    assert "--no-learn" in off["server_command"] and "--no-learn" not in on["server_command"]


def test_an_interleaved_ceiling_run_with_no_learner_on_either_arm_runs_without_pausing(tmp_path, monkeypatch):
    """A ceiling run (both arms --no-learn, the "on" arm another draft) has no learner to pause: a pause request
    there is an HTTP error, so the interleaved bench must not send one."""
    stream = tmp_path / "stream.jsonl"
    stream.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def add(a, b):", "Sort a list.", "x = 1"]))
    paused = []
    monkeypatch.setattr(live, "set_learner_paused", lambda server, p: paused.append(p))
    config = LiveConfig(models="tiny", stream=str(stream), requests=3, loads=(0.5,), capacity=4.0, window=3,
                        max_tokens=8, scrape_every=0.5, osd_args=("--threads", "1"), learn_args=("--no-learn",),
                        interleave=2)
    entry = run_live(config, str(tmp_path / "logs"), progress=lambda *_: None)["loads"][0]
    assert paused == [] and entry["comparison"]["greedy_identical"] == {"same": 3, "of": 3}
    assert "--no-learn" in entry["arms"]["on"]["server_command"]


def test_paired_block_bootstrap_intervals_cover_the_ratio_and_widen_with_slow_spells():
    from osd_bench.live import median_ratio, paired_interval, ratio_of_means

    rng = __import__("random").Random(1)
    off = [rng.uniform(10, 30) for _ in range(200)]  # prompts differ in difficulty; both arms see the same ones
    steady = [x * 1.2 for x in off]
    lo, hi = paired_interval(steady, off, ratio_of_means, block=25)
    assert lo == pytest.approx(1.2) and hi == pytest.approx(1.2)  # the same ratio on every request: no spread
    noisy = [x * rng.uniform(0.9, 1.5) for x in off]
    lo, hi = paired_interval(noisy, off, ratio_of_means, block=25)
    assert lo < ratio_of_means(noisy, off) < hi and lo > 1.1
    lo, hi = paired_interval(noisy, off, median_ratio, block=25)
    assert lo < median_ratio(noisy, off) < hi
    # no effect, but the machine slows one arm for a whole block at a time (a slow spell): per-request resampling
    # takes each spell for 25 independent draws and gives too narrow an interval; per block it holds 1
    spells = [x * (0.85 if (i // 25) % 2 else 1.15) * (1 + rng.uniform(-0.05, 0.05)) for i, x in enumerate(off)]
    lo, hi = paired_interval(spells, off, ratio_of_means, block=25)
    narrow = paired_interval(spells, off, ratio_of_means, block=1)
    assert lo < 1.0 < hi and hi - lo > 2 * (narrow[1] - narrow[0])
    assert paired_interval([1.0, None], [1.0, 2.0], ratio_of_means) is None  # fewer than 2 blocks measured
    again = paired_interval(noisy, off, ratio_of_means, 25, seed=3)
    assert paired_interval(noisy, off, ratio_of_means, 25, seed=3) == again


def test_recompare_rewrites_a_result_files_comparison_from_its_rows(tmp_path):
    import json

    from osd_bench.live import recompare

    on_rows, off_rows = _rows([12.0] * 8), _rows([10.0] * 8)
    arm = lambda rows: {"rows": rows, "scrapes": [], "windows": windows(rows, [], 4)}  # noqa: E731
    path = tmp_path / "live.json"
    path.write_text(json.dumps({"config": {"window": 4}, "loads": [
        {"load": 0.5, "rate_per_s": 1.0, "arms": {"on": arm(on_rows), "off": arm(off_rows)},
         "comparison": {"stale": True}}]}))
    recompare(str(path))
    saved = json.loads(path.read_text())
    c = saved["loads"][0]["comparison"]
    assert "stale" not in c and c["last_quarter_ratio"] == pytest.approx(1.2)
    assert c["mean_ratio"] == pytest.approx(1.2) and c["mean_ratio_interval"] == pytest.approx([1.2, 1.2])
    assert "git_revision" in saved["comparison_recomputed"]


def test_a_block_progress_line_gives_both_arms_speed_their_ratio_and_the_draft_version():
    from osd_bench.live import block_line

    def row(tps, version, ok=True):
        return {"ok": ok, "decode_tps": tps, "draft_version": version, "arrival": 0.0, "done": 1.0, "ttft": 0.1,
                "proposed": 4, "accepted": 2, "steps": 10, "completion_tokens": 12}

    on = [row(12.0, 2), row(18.0, 3), row(None, 3), row(90.0, 9, ok=False)]  # a failed request counts for neither
    off = [row(10.0, 0), row(14.0, 0)]
    assert block_line(on, off) == "decode 15.00 tokens/s learning on (draft v3), 12.00 off: 1.25x"
    assert block_line([row(None, 0)], off) == "no decode speed measured in this block"


def test_an_arm_records_its_server_s_calibration_line_from_the_log(tmp_path):
    from osd_bench.live import calibration_of

    log = tmp_path / "server.log"
    log.write_text("[osd] loading\n2026-11-30 07:00:00 INFO osd.serve: calibrated: a target pass of 1 row 60.1 ms, "
                   "2 rows 1.20x\nINFO osd.stats: running 0\n")
    assert calibration_of(str(log)) == "calibrated: a target pass of 1 row 60.1 ms, 2 rows 1.20x"
    log.write_text("no such line\n")
    assert calibration_of(str(log)) is None and calibration_of(str(tmp_path / "missing.log")) is None
