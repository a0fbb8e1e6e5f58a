"""Where do the draft's greedy disagreements sit? Agreement by the target's own confidence (top-1 probability).

For each dataset: cached target outputs (no target run), one teacher-forced forward of each draft, then
the share of positions and the draft's greedy agreement in buckets of the target's top-1 probability.
Drafts: the original, and optionally online checkpoints (`--checkpoint name=dir`, trained top layers only).
`osd eval` prints the same buckets for any draft directory (`osd export-draft` makes one from a checkpoint).

    python scripts/agreement_by_confidence.py --dataset spider code --split test --limit 40 \
        --checkpoint spider_online=runs/ckpt-spider500 --checkpoint code_online=runs/ckpt-code500
"""
from __future__ import annotations

import argparse
import json
import sys

from osd.config import ModelConfig
from osd.distill.cache import DecodeSettings
from osd.distill.evaluate import position_stats, sample_item, summarize
from osd.distill.target_outputs import dataset_samples
from osd.learn.checkpoint import load_checkpoint
from osd.models.loading import load_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", nargs="+", default=["spider", "code"])
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--checkpoint", action="append", default=[], help="name=dir of an online checkpoint")
    p.add_argument("--out", default="benchmarks/learning/agreement-by-confidence.json")
    args = p.parse_args(argv)
    models = ModelConfig()
    drafts = {"original": load_model(models.draft, models.draft_dtype)}
    for spec in args.checkpoint:
        name, directory = spec.split("=", 1)
        draft = load_model(models.draft, models.draft_dtype)
        if load_checkpoint(directory, draft) is None:
            raise SystemExit(f"no checkpoint in {directory}")
        drafts[name] = draft
    result = {"command": " ".join(["python", "scripts/agreement_by_confidence.py", *sys.argv[1:]]), "datasets": {}}
    for dataset in args.dataset:
        samples, _ = dataset_samples(models, dataset, args.split, args.limit, DecodeSettings(max_new_tokens=args.max_new_tokens))
        top1 = [p for s in samples for p in s.target.probs[:, 0].tolist()]
        rows = {}
        for name, draft in drafts.items():
            summary = summarize(position_stats(draft, [sample_item(s) for s in samples], samples), k=4)
            rows[name] = {"agreement": summary["alpha_greedy"], "buckets": summary["by_target_confidence"]}
        result["datasets"][dataset] = {"positions": len(top1), "mean_target_top1": sum(top1) / len(top1), "drafts": rows}
        for name, r in rows.items():
            cells = ", ".join(f"{b['bucket']}: {b['share']:.2f} of positions, agreement "
                              + ("-" if b["agreement"] is None else f"{b['agreement']:.3f}") for b in r["buckets"])
            print(f"{dataset} {name}: agreement {r['agreement']:.3f}; {cells}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"result written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
