"""The live replay's side-by-side speed report: llama.cpp target-only refused off a GGUF, and the start-vs-end line."""
import pytest

from osd_bench.replay import llama_cpp_gguf
from osd_bench.report import report_replay, start_vs_end
from osd.config import ModelConfig
from osd.errors import InvalidArgument


def _rows(n: int, online: float, online_end: float) -> list[dict]:
    """n requests: online tok/s `online` in the first half, `online_end` in the second; the other arms constant."""
    return [{"i": i, "id": f"x-{i}", "domain": "code", "draft_version": i // 4, "alpha": 0.3, "tokens_per_step": 1.5,
             "tokens_per_second": online if i < n // 2 else online_end, "static_alpha": 0.3,
             "static_tokens_per_step": 1.4, "static_tokens_per_second": 20.0, "target_only_tokens_per_second": 25.0,
             "llama_cpp_target_tokens_per_second": 30.0} for i in range(n)]


def report_text(rows: list[dict], tmp_path) -> str:
    """The BENCHMARKS.md block report_replay writes for these rows."""
    result = {"config": {"spec": {"k": 6}, "learn": {"loss": "forward_kl", "mode": "all", "every_requests": 8,
                                                     "lr": 2e-4}, "stream": "code"},
              "requests": rows,
              "learner": {"updates_published": 1, "updates_rejected": 0, "version": 1, "train_seconds": 3.0}}
    markdown = tmp_path / "B.md"
    report_replay(result, str(tmp_path / "r.json"), str(markdown), window=2)
    return markdown.read_text()


def test_llama_cpp_target_refused_without_a_gguf(tmp_path):
    with pytest.raises(InvalidArgument, match="needs a GGUF target"):
        llama_cpp_gguf(ModelConfig(target=str(tmp_path)))


def test_llama_cpp_target_takes_the_gguf_file(tmp_path):
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    assert llama_cpp_gguf(ModelConfig(target=str(gguf))) == gguf


def test_start_vs_end_ratios():
    first = {"online": 20.0, "online_compared": 20.0, "static": 20.0, "plain": 25.0, "llama": 30.0}
    last = {"online": 33.0, "online_compared": 33.0, "static": 22.0, "plain": 25.0, "llama": 30.0}
    line = start_vs_end(first, last)
    assert "last quarter / first quarter: 1.65x" in line
    assert "online / the control: 1.50x" in line
    assert "online / osd target-only: 1.32x" in line
    assert "online / llama.cpp target-only: 1.10x" in line
    assert "llama.cpp" not in start_vs_end(first, {**last, "llama": None})


def test_with_compare_every_the_ratios_to_other_arms_use_the_online_speed_on_the_same_requests(tmp_path):
    rows = _rows(16, 20.0, 40.0)
    for r in rows:
        if r["i"] % 2:  # the other arms decoded the even requests only
            for key in ("static_alpha", "static_tokens_per_step", "static_tokens_per_second",
                        "target_only_tokens_per_second", "llama_cpp_target_tokens_per_second"):
                del r[key]
        elif r["i"] >= 8:
            r["tokens_per_second"] = 50.0  # online on the compared requests of the second half
    text = report_text(rows, tmp_path)
    assert "last quarter / first quarter: 2.25x" in text  # all 4 rows of each quarter: 20 -> (40+50+40+50)/4
    assert "online / osd target-only: 2.00x" in text  # the compared rows only: 50 / 25, not 45 / 25
    assert "decoded 8 of 16 requests" in text and "static 0 of 8" in text


def test_report_has_the_llama_cpp_column_and_the_ratio(tmp_path):
    text = report_text(_rows(8, 20.0, 40.0), tmp_path)
    assert "tok/s llama.cpp target-only" in text
    assert "last quarter / first quarter: 2.00x" in text  # 2 of 8 rows per quarter: 20 at the start, 40 at the end
    assert "online / llama.cpp target-only: 1.33x" in text


def test_replay_serves_at_a_fixed_k_unless_asked():
    from osd.cli import build_parser

    assert build_parser().parse_args(["replay"]).adaptive is False
    assert build_parser().parse_args(["replay", "--adaptive"]).adaptive is True
    assert build_parser().parse_args(["replay", "--llama-cpp-target"]).llama_cpp_target is True


def test_warm_up_runs_every_arm_once_unseen_by_the_learner():
    from types import SimpleNamespace

    from osd_bench.replay import _warm_up
    from osd.config import SamplingConfig
    calls = []
    learner_observer = lambda *a: calls.append("learner saw it")

    def online_generate(ids, sampling):
        calls.append(("online", list(ids), bool(online.observers or online.request_observers)))

    online = SimpleNamespace(observers=[learner_observer], request_observers=[learner_observer],
                             metrics=SimpleNamespace(reset=lambda: calls.append("metrics reset")), generate=online_generate)
    static = lambda ids, sampling: calls.append(("static", list(ids)))
    llama_cpp = lambda ids: calls.append(("llama.cpp", list(ids)))
    _warm_up(online, [static], llama_cpp, [1, 2, 3], SamplingConfig(max_new_tokens=4))
    assert calls == [("online", [1, 2, 3], False), "metrics reset", ("static", [1, 2, 3]), ("llama.cpp", [1, 2, 3])]
    assert online.observers == [learner_observer] and online.request_observers == [learner_observer]  # restored


def test_a_request_without_proposals_has_no_alpha_not_an_alpha_of_zero(tmp_path):
    from osd_bench.plots import moving_average

    rows = _rows(8, 20.0, 20.0)
    for r in rows[:2]:
        r["static_alpha"] = None  # the policy chose k = 0 for the control on the first quarter's requests
    rows[2]["static_alpha"] = 0.5
    text = report_text(rows, tmp_path)
    all_row = next(line for line in text.splitlines() if line.startswith("| all"))
    assert all_row.split("|")[3].strip() == f"{(0.5 + 5 * 0.3) / 6:.3f}"  # alpha static over the 6 requests with proposals
    first = next(line for line in text.splitlines() if line.startswith("| first quarter"))
    assert first.split("|")[3].strip() in ("", "None", "n/a", "-")  # no proposals at all in the first quarter
    assert "requests without proposals: online 0 of 8, static 2 of 8" in text
    curve = moving_average([None, 0.2, None, 0.4], 2)
    assert curve[0] != curve[0] and curve[1:] == [0.2, 0.2, 0.4]  # NaN, then the present values' means


def test_live_replay_with_compare_every_runs_the_other_arms_on_every_nth_request_only(tmp_path):
    from conftest import save_tiny_pair

    from osd_bench.replay import run_replay
    from osd.config import SpeculationConfig
    from osd.learn.online import LearnConfig

    save_tiny_pair(tmp_path, draft_layers=1)
    models = ModelConfig(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), draft_quantize="none",
                         prepack_target=False)
    learn = LearnConfig(mode="all", every_requests=2, trainable="all", train_layers=0, guard=False, lr=1e-2,
                        steps_per_update=1, batch_size=2)
    result = run_replay(models, SpeculationConfig(k=3, adaptive=False), learn, "code", "test", 5, 6, baseline=False,
                        target_only=True, compare_every=2)
    rows = result["requests"]
    assert [("static_tokens_per_second" in r, "target_only_tokens_per_second" in r) for r in rows] == \
        [(True, True), (False, False), (True, True), (False, False), (True, True)]
    assert all(r["tokens_per_second"] for r in rows) and all("online_alpha" in r for r in rows if r["positions"])
    assert result["config"]["compare_every"] == 2
    with pytest.raises(InvalidArgument, match="compare_every"):
        run_replay(models, SpeculationConfig(k=3), learn, "code", "test", 5, 6, compare_every=0)


def _live_result(rows: list[dict]) -> dict:
    return {"config": {"spec": {"k": 6}, "learn": {"loss": "forward_kl", "mode": "all", "every_requests": 8, "lr": 2e-4},
                       "stream": "code"},
            "requests": rows, "metrics_by_draft_version": {},
            "learner": {"updates_published": 1, "updates_rejected": 0, "version": 1, "train_seconds": 3.0}}


def test_speed_plot_draws_every_arm_on_the_requests_they_all_decoded(tmp_path, monkeypatch):
    import osd_bench.report as report

    rows = _rows(6, 20.0, 40.0)
    for r in rows[1::2]:  # --compare-every 2: the other arms skipped the odd requests
        for key in ("static_tokens_per_second", "target_only_tokens_per_second", "llama_cpp_target_tokens_per_second"):
            del r[key]
    drawn = {}
    monkeypatch.setattr(report, "plot_alpha_curves", lambda curves, boundaries, title, ylabel, path, window, x:
                        drawn.update(curves=curves, x=x, ylabel=ylabel) or path)
    assert report.plot_live_speed(_live_result(rows), str(tmp_path / "s.png")) == str(tmp_path / "s.png")
    assert drawn["x"] == [0, 2, 4] and drawn["ylabel"] == "tokens/s"
    assert drawn["curves"] == {"online (osd, learning)": [20.0, 20.0, 40.0], "control (never trained)": [20.0] * 3,
                               "osd target-only": [25.0] * 3, "llama.cpp target-only": [30.0] * 3}
    for r in rows:  # no request decoded by the other arms: nothing to compare, no plot
        r.pop("static_tokens_per_second", None)
    assert report.plot_live_speed(_live_result(rows), str(tmp_path / "t.png")) is None


def test_from_result_re_renders_the_report_with_the_recorded_command_and_measures_nothing(tmp_path, monkeypatch):
    import json

    import osd_bench.replay as replay
    from osd.cli import main

    monkeypatch.setattr(replay, "run_replay", lambda *a, **k: pytest.fail("--from-result must not measure"))
    result = {**_live_result(_rows(8, 20.0, 40.0)), "command": "osd replay --stream code --per-segment 8",
              "git_revision": "abc1234", "timestamp": "2026-11-26T06:00:00Z", "machine": {"cpu": "Some CPU"}}
    source = tmp_path / "live.json"
    source.write_text(json.dumps(result))
    markdown = tmp_path / "B.md"
    assert main(["replay", "--from-result", str(source), "--markdown", str(markdown), "--window", "2"]) == 0
    text = markdown.read_text()
    assert "`osd replay --stream code --per-segment 8` (measured at rev abc1234, 2026-11-26T06:00:00Z)" in text
    assert "machine: Some CPU" in text and "last quarter / first quarter: 2.00x" in text
    assert json.loads(source.read_text())["git_revision"] == "abc1234"  # the recorded provenance is kept
    assert "live.speed.png" in text


def test_from_result_refuses_a_file_that_is_not_a_live_replay(tmp_path, capsys):
    from osd.cli import main

    fast = tmp_path / "fast.json"
    fast.write_text('{"config": {}, "requests": [], "learner": {}}')  # a fast replay has no engine metrics
    assert main(["replay", "--from-result", str(fast), "--markdown", ""]) == 2
    assert "not the result this command reads (no metrics_by_draft_version)" in capsys.readouterr().err
    assert main(["replay", "--from-result", str(tmp_path / "missing.json"), "--markdown", ""]) == 2
    assert "not a result JSON" in capsys.readouterr().err


def test_ratio_interval_pairs_requests_decoded_by_both_arms():
    """Online = 1.5x the control on every request, request speeds spread 10-40 tok/s: pairing the same requests
    gives exactly 1.5; resampling each arm on its own (what unpaired would do) spreads around it."""
    from osd_bench.report import ratio_interval

    control = [10.0 + 30.0 * (i % 7) / 6 for i in range(21)]
    online = [1.5 * c for c in control]
    lo, hi = ratio_interval(online, control, paired=True)
    assert lo == pytest.approx(1.5) and hi == pytest.approx(1.5)
    lo, hi = ratio_interval(online, control, paired=False)
    assert lo < 1.4 and hi > 1.6
    assert ratio_interval([1.0], [1.0, 2.0], paired=False) is None


def test_report_states_each_headline_ratio_with_its_interval(tmp_path):
    rows = _rows(16, 20.0, 40.0)
    for r in rows:
        r["static_tokens_per_second"] = r["tokens_per_second"] / 1.25  # online 1.25x the control on every request
    text = report_text(rows, tmp_path)
    assert "online / the control: 1.25x (95% CI 1.25-1.25)" in text
    assert "last quarter / first quarter: 2.00x (95% CI 2.00-2.00)" in text  # constant within each quarter
