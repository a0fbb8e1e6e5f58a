"""`osd target-cache` / `osd distill` / `osd eval` / live `osd replay` end to end on tiny model directories (HF format,
own tokenizer)."""
import json

import pytest
from conftest import save_tiny_pair

from osd.cli import main


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    save_tiny_pair(root, draft_layers=2)
    words = ["add two numbers", "select all rows", "count the apples", "sort a list", "find the max", "join tables"]
    with open(root / "tiny.jsonl", "w") as f:
        for i in range(36):
            split = "train" if i < 24 else "test"
            f.write(json.dumps({"id": f"t{i}", "domain": "tiny", "split": split, "prompt": f"{words[i % 6]} {chr(97 + i % 26)}{chr(97 + i // 26)}"}) + "\n")
    return root


def common(root):
    return ["--target", str(root / "target"), "--draft", str(root / "draft"), "--dataset", str(root / "tiny.jsonl"),
            "--max-new-tokens", "8", "--top-k", "8", "--no-prepack-target", "--cache-dir", str(root / "cache")]


def test_target_cache_distill_eval_and_resume(workspace, capsys):
    root = workspace
    assert main(["target-cache", *common(root), "--split", "train", "--limit", "24"]) == 0
    assert len(list((root / "cache").rglob("*.safetensors"))) == 24
    distill = ["distill", *common(root), "--limit", "24", "--eval-limit", "8", "--epochs", "3", "--lr", "1e-2",
               "--batch-size", "4", "--train-layers", "1", "--out", str(root / "run")]
    assert main(distill) == 0
    metrics = json.loads((root / "run" / "draft" / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 18 and metrics["peak_rss_gib"] > 0
    assert metrics["eval_after"]["alpha_greedy"] >= metrics["eval_before"]["alpha_greedy"]
    assert json.loads((root / "run" / "draft" / "osd_config.json").read_text())["distill"]["train_layers"] == 1
    assert main(distill) == 0  # rerun: resumes from the finished state, trains nothing more
    again = json.loads((root / "run" / "draft" / "metrics.json").read_text())
    assert again["resumed"] and again["optimizer_steps"] == 18
    capsys.readouterr()
    assert main(["eval", *common(root), "--limit", "8", "--drafts", str(root / "draft"), str(root / "run" / "draft"),
                 "--out", str(root / "eval.json"), "--markdown", str(root / "B.md")]) == 0
    result = json.loads((root / "eval.json").read_text())
    assert set(result["drafts"]) == {str(root / "draft"), str(root / "run" / "draft")}
    assert "alpha greedy" in capsys.readouterr().out and "Draft acceptance" in (root / "B.md").read_text()
    assert "agreement, target top-1 in [0.9, 1.0]" in (root / "B.md").read_text()


def test_bad_arguments_are_clear_errors(workspace, capsys):
    root = workspace
    assert main(["distill", *common(root), "--loss", "l2", "--out", str(root / "bad")]) == 2
    assert "loss must be one of" in capsys.readouterr().err
    assert main(["eval", *common(root), "--dataset", "no-such-dataset"]) == 2
    assert "dataset not found" in capsys.readouterr().err
    assert main(["distill", *common(root), "--train-layers", "-1", "--out", str(root / "bad2")]) == 2
    assert "train_layers" in capsys.readouterr().err


def test_live_replay_learns_checkpoints_and_resumes(workspace, capsys):
    """Real decoding of a stream, side by side with the static original draft and the target alone; a second run
    resumes the learned draft from the checkpoint (the way the live benchmark starts from a replayed draft)."""
    root = workspace
    live = ["replay", "--target", str(root / "target"), "--draft", str(root / "draft"), "--stream", str(root / "tiny.jsonl"),
            "--split", "train", "--per-segment", "8", "--max-new-tokens", "8", "--no-prepack-target", "--target-only",
            "--every-requests", "4", "--lr", "1e-2", "--no-guard", "--train-layers", "1", "--mode", "all",
            "--draft-quantize", "none", "--checkpoint-dir", str(root / "ckpt"), "--markdown", str(root / "L.md")]
    assert main([*live, "--out", str(root / "live1.json")]) == 0
    first = json.loads((root / "live1.json").read_text())
    rows = first["requests"]
    assert len(rows) == 8 and first["learner"]["updates_published"] == 2 and rows[0]["draft_version"] == 0
    assert rows[-1]["draft_version"] == 1  # published after request 4, served from request 5 on
    assert all(r["tokens_per_second"] > 0 and r["target_only_tokens_per_second"] > 0 and r["static_alpha"] is not None
               for r in rows)
    assert main([*live, "--out", str(root / "live2.json")]) == 0
    second = json.loads((root / "live2.json").read_text())
    assert second["requests"][0]["draft_version"] == 2  # resumed where the first run stopped
    assert "(> 0: resumed from a checkpoint)" in (root / "L.md").read_text()

    # the learned draft as a plain model directory, which osd eval takes like any other draft
    assert main(["export-draft", "--checkpoint", str(root / "ckpt"), "--draft", str(root / "draft"),
                 "--out", str(root / "exported")]) == 0
    provenance = json.loads((root / "exported" / "draft" / "osd_config.json").read_text())["exported_from_checkpoint"]
    assert provenance["version"] == second["learner"]["version"] and (root / "exported" / "draft" / "tokenizer.json").exists()
    assert main(["eval", *common(root), "--limit", "4", "--drafts", str(root / "exported" / "draft"),
                 "--out", str(root / "eval-exported.json"), "--markdown", ""]) == 0
    # resuming onto another base draft (the target has the draft's shape here) is a clear error, not a mixed draft
    assert main([*[a if a != str(root / "draft") else str(root / "target") for a in live], "--out", str(root / "x.json")]) == 2
    assert "another base draft" in capsys.readouterr().err


def test_fast_replay_cli_with_heldout_requests(workspace):
    root = workspace
    out = root / "fast.json"
    assert main(["replay", "--fast", *common(root)[:4], "--stream", str(root / "tiny.jsonl"), "--per-segment", "12",
                 "--max-new-tokens", "8", "--top-k", "8", "--no-prepack-target", "--cache-dir", str(root / "cache"),
                 "--every-requests", "4", "--train-layers", "1", "--heldout", "6", "--out", str(out),
                 "--markdown", str(root / "F.md")]) == 0
    result = json.loads(out.read_text())
    assert len(result["requests"]) == 12 and result["config"]["heldout_split"] == "test"
    rows = [json.loads(line) for line in (root / "fast.rows.jsonl").read_text().splitlines()]  # written as it went
    assert rows == result["requests"]
    (domain, alphas), = result["end_of_stream_alpha_on_heldout"].items()
    assert domain == str(root / "tiny.jsonl") and set(alphas) == {"original", "offline_10pct", "offline_100pct", "online"}
    assert "6 held-out requests per dataset" in (root / "F.md").read_text()
    paired = result["heldout_online_vs_offline_100pct"][domain]  # paired on the same held-out positions
    diff = alphas["online"] - alphas["offline_100pct"]
    assert (paired["gained"] - paired["lost"] > 0) == (diff > 0) and (paired["gained"] == paired["lost"]) == (diff == 0)
    assert "online vs offline_100pct on the same positions" in (root / "F.md").read_text()


def test_bench_train_step_times_both_paths_and_they_agree(workspace):
    root = workspace
    out = root / "train-step.json"
    assert main(["bench", "train-step", "--target", str(root / "target"), "--draft", str(root / "draft"),
                 "--dataset", str(root / "tiny.jsonl"), "--max-new-tokens", "8", "--top-k", "8", "--no-prepack-target",
                 "--cache-dir", str(root / "cache"), "--requests", "8", "--train-layers", "1", "--batch-size", "4",
                 "--repeats", "2", "--out", str(out), "--markdown", str(root / "B.md")]) == 0
    result = json.loads(out.read_text())
    assert result["rows_only_supported"] and result["config"]["requests"] == 8
    assert all(len(v) == 2 and min(v) > 0 for v in result["seconds_per_forward_backward"].values())
    assert result["max_loss_difference"] < 1e-4 and result["max_relative_gradient_difference"] < 1e-3
    assert set(result["seconds_per_forward_backward"]) == {"whole_layer", "rows_only", "rows_only_bf16"}
    assert 0 < result["max_bf16_gradient_difference_l2"] < 0.1  # bf16 did round, and stayed close
    assert set(result["optimizer_step_seconds"]) == {"adamw_loop", "adamw_fused"}
    assert all(v > 0 for v in result["optimizer_step_seconds"].values())
    assert "## Training step (`osd bench train-step`)" in (root / "B.md").read_text()
