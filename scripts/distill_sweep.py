"""Compare distillation losses and sample sources on one dataset, in one process.

    python scripts/distill_sweep.py --dataset spider --limit 100 --epochs 2 --source-epochs 1 --eval-limit 40

Every run starts from the original draft with the same data, steps and learning rate; only the loss (teacher
samples) or the sample source (forward KL) changes. Teacher runs share the frozen-trunk features (computed
once), so the sweep costs little more than one run per loss. Writes each draft under --out, a JSON with every
run's metrics, and a table (alpha on the held-out split before/after, implied speedup; --markdown FILE appends it).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from osd.records import append_markdown, git_revision, machine, write_result
from osd_bench.report import table
from osd.config import ModelConfig
from osd.distill.cache import DecodeSettings
from osd.distill.cli import newest_calibration, progress_bar
from osd.distill.run import run_distill
from osd.distill.trainer import DistillConfig

LOSSES = ("forward_kl", "reverse_kl", "jsd", "tv", "reference_mix")
SOURCES = ("student", "mix_token", "mix_request")


def prune_run_dir(out: str, keep_draft: bool) -> None:
    """Drop the resumable trainer state (a finished run needs none) and, unless kept, the draft's weights."""
    import shutil
    from pathlib import Path

    shutil.rmtree(Path(out) / "trainer-state", ignore_errors=True)
    if not keep_draft:
        for weights in (Path(out) / "draft").glob("*.safetensors"):
            weights.unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="spider")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--eval-limit", type=int, default=40)
    p.add_argument("--epochs", type=int, default=1, help="epochs of the loss runs (teacher samples)")
    p.add_argument("--source-epochs", type=int, default=1, help="epochs of the source runs (each epoch resamples "
                   "with the current draft; a teacher forward-KL run at this many epochs is added for reference)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--train-layers", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--sources", default=",".join(SOURCES), help="sample sources trained with forward KL ('' = none)")
    p.add_argument("--out", default="runs/sweep")
    p.add_argument("--keep-drafts", action="store_true", help="keep each run's draft directory (~2.4 GB each for the "
                   "0.5B draft in fp32); by default only its metrics.json and osd_config.json stay")
    p.add_argument("--json", default="")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    args = p.parse_args()

    models, settings = ModelConfig(), DecodeSettings(max_new_tokens=args.max_new_tokens)
    base = DistillConfig(epochs=args.epochs, lr=args.lr, train_layers=args.train_layers)
    runs = [(f"teacher/{loss}", replace(base, loss=loss)) for loss in args.losses.split(",") if loss]
    sources = [source for source in args.sources.split(",") if source]
    if sources and args.source_epochs != args.epochs:
        runs.append((f"teacher/forward_kl ({args.source_epochs} epoch)", replace(base, epochs=args.source_epochs)))
    runs += [(f"{source}/forward_kl", replace(base, source=source, epochs=args.source_epochs)) for source in sources]
    calibration = newest_calibration(models=models)
    features: dict = {}  # teacher samples' frozen-trunk features, shared by the teacher runs
    results = {}
    for name, config in runs:
        print(f"=== {name}", flush=True)
        run_dir = f"{args.out}/{name.replace('/', '-').replace(' ', '_')}"
        results[name] = run_distill(models, settings, config, args.dataset, "train", args.limit,
                                    run_dir, eval_split="test", eval_limit=args.eval_limit,
                                    progress=progress_bar("target outputs"), calibration=calibration, items_cache=features,
                                    eval_before=not results)
        results[name].pop("losses", None)
        prune_run_dir(run_dir, args.keep_drafts)
    first = next(iter(results.values()))["eval_before"]
    rows = [["original draft", None, None, first["alpha_greedy"], first["tokens_per_step_greedy"],
             first["alpha_sampling_t1"], first.get("implied_speedup_greedy"), None, None]]
    for name, m in results.items():
        a = m["eval_after"]
        rows.append([name, m["loss_first"], m["loss_last"], a["alpha_greedy"], a["tokens_per_step_greedy"],
                     a["alpha_sampling_t1"], a.get("implied_speedup_greedy"), m["seconds"], m["peak_rss_gib"]])
    header = ["source/loss", "loss first", "loss last", "alpha greedy", "tokens/step greedy", "alpha T=1",
              "implied speedup greedy", "seconds", "peak RSS GiB"]
    t = table(rows, header)
    print(t)
    out = {"config": vars(args), "calibration": calibration, "runs": results}
    path = write_result(out, args.json or f"benchmarks/learning/distill-sweep-{args.dataset}.json")
    if args.markdown:
        m = machine()
        notes = (f"{args.dataset}: train first {args.limit} prompts, {args.epochs} epoch(s) for the losses, "
                 f"{args.source_epochs} for the sources (resampled each epoch), lr {args.lr}, "
                 f"train_layers {args.train_layers}; alpha on test first {args.eval_limit} prompts (target greedy, "
                 f"{args.max_new_tokens} tokens); implied speedup at the best k with c={calibration['c']:.3f} from "
                 f"{calibration['source']}" if calibration else "no calibration: implied speedups omitted")
        append_markdown("Distillation losses and sources (`scripts/distill_sweep.py`)", [
            f"### {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} rev {git_revision()}",
            f"`python scripts/distill_sweep.py {' '.join(sys.argv[1:])}`; machine: {m['cpu']}, {m['cores']} cores; "
            f"JSON: `{path}`", "", t, "", notes], args.markdown)


if __name__ == "__main__":
    main()
