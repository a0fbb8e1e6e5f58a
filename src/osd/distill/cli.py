"""CLI entries for distillation: `osd target-cache`, `osd distill`, `osd eval`, `osd export-draft`.
Parse -> config -> call the library."""
from __future__ import annotations

import json
import time

from osd.flags import add_config_flags, config_from


def add_stream_flags(p, split: str = "train", limit: int = 200) -> None:
    p.add_argument("--dataset", default="gsm8k", help="dataset name (shared/datasets) or JSONL path "
                   "(osd distill: a comma list trains on all of them)")
    p.add_argument("--split", default=split)
    p.add_argument("--limit", type=int, default=limit, help="records to use (in file order)")
    p.add_argument("--offset", type=int, default=0, help="records to skip first")
    p.add_argument("--batch-size-generate", dest="batch_size_generate", type=int, default=8,
                   help="prompts per target forward when filling the target-output cache")
    p.add_argument("--cache-dir", default=None, help="target-output cache root (default $OSD_CACHE/teacher)")


def register(sub) -> None:
    from osd.config import ModelConfig
    from osd.distill.cache import DecodeSettings

    p = sub.add_parser("target-cache", help="fill the target-output cache (responses + distributions) for a dataset")
    add_stream_flags(p)
    for cls in (ModelConfig, DecodeSettings):
        add_config_flags(p, cls)
    p.set_defaults(func=cmd_target_cache)

    from osd.distill.trainer import DistillConfig

    p = sub.add_parser("distill", help="distill the draft offline on target samples -> a draft checkpoint directory")
    add_stream_flags(p)
    p.add_argument("--out", required=True, help="output directory (rerun with the same one to resume)")
    p.add_argument("--eval-split", default="test")
    p.add_argument("--eval-limit", type=int, default=0, help="also measure alpha before/after on this many held-out prompts")
    for cls in (ModelConfig, DecodeSettings, DistillConfig):
        add_config_flags(p, cls)
    p.set_defaults(func=cmd_distill)

    p = sub.add_parser("eval", help="alpha and tokens/step of drafts against the target on held-out prompts")
    add_stream_flags(p, split="test", limit=40)
    p.add_argument("--drafts", nargs="+", default=None, help="draft specs to compare (default: --draft)")
    p.add_argument("--k", type=int, default=4, help="proposal length for tokens/step")
    p.add_argument("--calibration", default="", help="an `osd bench speed` JSON for c and verify costs, or 'none' "
                   "(default: of benchmarks/bench-speed-*.json with the same draft settings, the newest by the date "
                   "recorded inside it)")
    p.add_argument("--out", default="benchmarks/learning/eval.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    for cls in (ModelConfig, DecodeSettings):
        add_config_flags(p, cls)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export-draft", help="an online or trainer checkpoint -> a plain draft model directory "
                       "(for osd eval / generate / serve --draft)")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (--checkpoint-dir of osd serve --learn / "
                   "osd replay, or <out>/trainer-state of osd distill)")
    p.add_argument("--draft", default=ModelConfig.draft, help="the base draft the checkpoint was trained on")
    p.add_argument("--draft-dtype", default="float32")
    p.add_argument("--out", required=True, help="output directory; the model goes to <out>/draft")
    p.set_defaults(func=cmd_export_draft)


def progress_bar(desc: str):
    from tqdm import tqdm

    return lambda **kw: tqdm(**{"desc": desc, "unit": "req", **kw})


def cmd_target_cache(args) -> None:
    from osd.config import ModelConfig
    from osd.distill.cache import DecodeSettings
    from osd.distill.target_outputs import dataset_samples

    start = time.perf_counter()
    samples, _ = dataset_samples(config_from(args, ModelConfig), args.dataset, args.split, args.limit,
                                 config_from(args, DecodeSettings), args.offset, args.batch_size_generate,
                                 args.cache_dir, progress_bar("target outputs"))
    tokens = sum(len(s.response_ids) for s in samples)
    print(json.dumps({"dataset": args.dataset, "split": args.split, "samples": len(samples), "response_tokens": tokens,
                      "seconds": round(time.perf_counter() - start, 1)}, indent=2))


def cmd_distill(args) -> None:
    from osd.config import ModelConfig
    from osd.distill.cache import DecodeSettings
    from osd.distill.evaluate import newest_calibration
    from osd.distill.run import run_distill
    from osd.distill.trainer import DistillConfig

    models = config_from(args, ModelConfig)
    metrics = run_distill(models, config_from(args, DecodeSettings), config_from(args, DistillConfig),
                          args.dataset, args.split, args.limit, args.out, args.offset, args.eval_split, args.eval_limit,
                          args.batch_size_generate, args.cache_dir, progress_bar("target outputs"),
                          newest_calibration(models=models))
    print(json.dumps({k: v for k, v in metrics.items() if k != "losses"}, indent=2, default=str))


def cmd_export_draft(args) -> None:
    from osd.distill.export import export_checkpoint
    from osd.models.loading import load_tokenizer

    out = export_checkpoint(args.checkpoint, args.draft, args.out, args.draft_dtype, load_tokenizer(args.draft))
    provenance = json.loads((out / "osd_config.json").read_text())["exported_from_checkpoint"]
    print(json.dumps({"draft_dir": str(out), "version": provenance["version"], "base_draft": args.draft}, indent=2))


def cmd_eval(args) -> None:
    from osd.config import ModelConfig
    from osd.distill.cache import DecodeSettings
    from osd.distill.evaluate import newest_calibration
    from osd.distill.report import report_eval
    from osd.distill.run import run_eval

    models = config_from(args, ModelConfig)
    result = run_eval(models, args.drafts or [models.draft], config_from(args, DecodeSettings), args.dataset, args.split,
                      args.limit, args.k, newest_calibration(args.calibration, models), args.batch_size_generate, args.cache_dir,
                      progress_bar("target outputs"), args.offset)
    report_eval(result, args.out, args.markdown)
