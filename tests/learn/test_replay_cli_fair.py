"""Both replays through the CLI on tiny model directories: the control, the online draft and the equal-step offline
drafts on the same requests, held-out pairs with z, the figure; the fast one resumable from its state file."""
import json

import pytest
from conftest import save_tiny_pair

from osd.cli import main


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("fair")
    save_tiny_pair(root, draft_layers=2)
    words = ["add two numbers", "select all rows", "count the apples", "sort a list", "find the max", "join tables"]
    with open(root / "tiny.jsonl", "w") as f:
        for i in range(28):
            split = "train" if i < 20 else "test"
            f.write(json.dumps({"id": f"t{i}", "domain": "tiny", "split": split,
                                "prompt": f"{words[i % 6]} {chr(97 + i % 26)}{chr(97 + i // 26)}"}) + "\n")
    return root


def models(root):
    return ["--target", str(root / "target"), "--draft", str(root / "draft"), "--stream", str(root / "tiny.jsonl"),
            "--max-new-tokens", "8", "--no-prepack-target", "--every-requests", "4", "--lr", "1e-2",
            "--train-layers", "1", "--heldout", "4"]


def test_live_replay_reports_every_draft_against_the_control(workspace):
    root = workspace
    out = root / "live.json"
    assert main(["replay", *models(root), "--split", "train", "--per-segment", "12", "--mode", "all", "--no-guard",
                 "--draft-quantize", "none", "--out", str(out), "--markdown", str(root / "L.md")]) == 0
    result = json.loads(out.read_text())
    assert result["variants"] == ["original", "offline_10pct", "offline_100pct", "online"]
    steps = result["learner"]["optimizer_steps"]
    assert steps == 3 * 8 and all(result["baselines"][n]["optimizer_steps"] == steps for n in ("offline_10pct", "offline_100pct"))
    assert result["baselines"]["offline_10pct"]["items"] == 1 and result["baselines"]["offline_100pct"]["items"] == 12
    rows = result["requests"]
    measured = [r for r in rows if r["positions"]]
    assert measured and all({"original_alpha", "online_alpha", "offline_100pct_alpha", "online_gained"} <= r.keys()
                            for r in measured)
    assert all(r["static_alpha"] is not None for r in rows)  # the control also served every request, live
    # the warm-up request before the stream is neither learned from nor counted
    assert result["learner"]["requests"] == 12
    assert sum(m["requests"] for m in result["metrics_by_draft_version"].values()) == 12
    (domain, alphas), = result["end_of_stream_alpha_on_heldout"].items()
    assert set(result["heldout_vs_control"][domain]) == {"offline_10pct", "offline_100pct", "online"}
    paired = result["heldout_vs_control"][domain]["online"]
    assert (paired["gained"] - paired["lost"] > 0) == (alphas["online"] > alphas["original"])
    text = (root / "L.md").read_text()
    assert "drafts against the control" in text and text.count("control (never trained)") >= 2
    assert (root / "live.drafts.png").stat().st_size > 1000


def test_fast_replay_cli_resumes_a_cut_run_and_removes_its_state(workspace, monkeypatch):
    root = workspace
    fast = ["replay", "--fast", *models(root), "--split", "train", "--per-segment", "16", "--top-k", "8",
            "--cache-dir", str(root / "cache"), "--save-every", "4", "--markdown", str(root / "F.md")]
    assert main([*fast, "--out", str(root / "uncut.json")]) == 0
    uncut = json.loads((root / "uncut.json").read_text())
    assert not (root / "uncut.state.pt").exists()  # finished: the state is gone

    import osd_bench.replay_fast as replay_fast

    online_row = replay_fast._online_row

    def cut_at_ten(i, *args):
        if i == 10:
            raise KeyboardInterrupt
        return online_row(i, *args)

    monkeypatch.setattr(replay_fast, "_online_row", cut_at_ten)
    assert main([*fast, "--out", str(root / "cut.json")]) == 130  # interrupted: the state holds requests 0..7
    assert (root / "cut.state.pt").exists() and len((root / "cut.rows.jsonl").read_text().splitlines()) == 10
    monkeypatch.setattr(replay_fast, "_online_row", online_row)
    assert main([*fast, "--out", str(root / "cut.json")]) == 0  # the same command again continues
    resumed = json.loads((root / "cut.json").read_text())
    assert resumed["requests"] == uncut["requests"] and resumed["learner"]["version"] == uncut["learner"]["version"]
    rows = [json.loads(line) for line in (root / "cut.rows.jsonl").read_text().splitlines()]
    assert rows == resumed["requests"] and not (root / "cut.state.pt").exists()
    assert "offline 100% (equal steps)" in (root / "F.md").read_text()


def test_a_kept_state_adds_a_baseline_without_replaying_the_stream(workspace, monkeypatch):
    root = workspace
    fast = ["replay", "--fast", *models(root), "--split", "train", "--per-segment", "16", "--top-k", "8",
            "--cache-dir", str(root / "cache"), "--markdown", str(root / "K.md"), "--out", str(root / "kept.json")]
    assert main([*fast, "--keep-state"]) == 0
    first = json.loads((root / "kept.json").read_text())
    assert (root / "kept.state.pt").exists()  # kept: a later run can add a draft to it

    import osd_bench.replay_fast as replay_fast

    def no_replay(*args):
        raise AssertionError("the stream was replayed instead of read from the kept state")

    monkeypatch.setattr(replay_fast, "_online_row", no_replay)
    assert main([*fast, "--baseline-arrival"]) == 0  # the stream's rows and learner come from the state
    added = json.loads((root / "kept.json").read_text())
    assert "offline_arrival" in added["variants"] and "offline_arrival" not in first["variants"]
    assert [r["online_alpha"] for r in added["requests"]] == [r["online_alpha"] for r in first["requests"]]
    assert added["baselines"]["offline_arrival"]["optimizer_steps"] == first["learner"]["optimizer_steps"]
    assert not (root / "kept.state.pt").exists()  # without --keep-state this run removes it
