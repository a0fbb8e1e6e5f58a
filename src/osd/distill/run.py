"""`osd distill` and `osd eval` as library calls: target samples -> train / measure -> files."""
from __future__ import annotations

import resource
import time
from dataclasses import asdict
from pathlib import Path

from osd.config import ModelConfig
from osd.distill.cache import DecodeSettings
from osd.distill.evaluate import position_stats, sample_item, serving_stats, summarize
from osd.distill.generate import decode_batch
from osd.distill.target_outputs import dataset_samples
from osd.distill.trainer import DistillConfig, DistillTrainer, export_draft
from osd.models.cached import CachedModel
from osd.models.loading import load_model, load_tokenizer
from osd.models.tokenizer import special_ids
from osd.propose.copy_choice import serving_copy
from osd.propose.draft_model import serving_runner


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def evaluate_draft(draft, samples, k: int = 4, calibration: dict | None = None, max_new_tokens: int | None = None,
                   copy=None) -> dict:
    """Acceptance of `draft` on cached target outputs (greedy exact, T = 1 expected): the master in torch, or with
    `copy` (a CopyChoice: propose/copy_choice.py) the serving copy that proposes, through its own runner."""
    if copy is None:
        stats = position_stats(draft, [sample_item(s) for s in samples], samples)
        return summarize(stats, k, calibration, max_new_tokens)
    runner = serving_runner(copy.serving) or CachedModel(copy.serving)
    stats = serving_stats(runner, copy.vocab_ids, int(draft.config.vocab_size), samples)
    return {**summarize(stats, k, calibration, max_new_tokens), "serving_copy": copy.quantize,
            "copy_seconds_per_token": copy.seconds or None}


def student_source(models: ModelConfig, draft, prompts_of, settings: DecodeSettings, config: DistillConfig, eos, pad):
    """Samples redrawn each epoch with the current draft (on-policy); the target scores every position."""
    from osd.distill.cache import TargetSample
    from osd.models.prepack import prepack_linears

    target = load_model(models.target, models.dtype)
    if models.prepack_target:
        prepack_linears(target, models.allow_kernel_fallback)

    def source(epoch: int):
        prompts = prompts_of()
        draft.eval()
        epoch_settings = DecodeSettings(settings.max_new_tokens, settings.temperature, settings.top_k, settings.seed + epoch)
        out = []
        for s in range(0, len(prompts), 8):
            chunk = prompts[s : s + 8]
            results = decode_batch(target, chunk, epoch_settings, eos, pad, draft, config.source, config.teacher_ratio)
            out += [TargetSample(p, r, d, {"source": config.source}) for p, (r, d) in zip(chunk, results)]
        return out

    return source


def run_distill(models: ModelConfig, settings: DecodeSettings, config: DistillConfig, dataset: str, split: str,
                limit: int, out: str, offset: int = 0, eval_split: str = "test", eval_limit: int = 0,
                batch_size_generate: int = 8, cache_dir=None, progress=None, calibration: dict | None = None,
                items_cache: dict | None = None, eval_before: bool = True) -> dict:
    """Distill the draft on target samples -> a draft directory + metrics (alpha before/after when eval_limit).

    calibration: c and verify costs (an `osd bench speed` result) for the implied speedups; items_cache: frozen-trunk
    features of teacher samples, shareable between runs with the same draft and train_layers (a sweep);
    eval_before False: skip measuring the starting draft (a sweep measures it once).
    """
    from osd.models.runner import eos_token_ids

    start = time.perf_counter()
    samples, eval_samples, tokenizer = [], [], None
    for name in dataset.split(","):  # several datasets: `limit` prompts of each, trained on together
        part, tokenizer = dataset_samples(models, name.strip(), split, limit, settings, offset, batch_size_generate,
                                          cache_dir, progress, tokenizer)
        samples += part
        if eval_limit:
            eval_samples += dataset_samples(models, name.strip(), eval_split, eval_limit, settings, 0,
                                            batch_size_generate, cache_dir, progress, tokenizer)[0]
    draft = load_model(models.draft, models.draft_dtype)
    measure = lambda: evaluate_draft(draft, eval_samples, calibration=calibration, max_new_tokens=settings.max_new_tokens)
    before = measure() if eval_samples and eval_before else None
    trainer = DistillTrainer(draft, config, Path(out) / "trainer-state")
    resumed = trainer.resume()
    if config.source == "teacher":
        source = lambda epoch: samples
    else:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        source = student_source(models, draft, lambda: [s.prompt_ids for s in samples], settings, config,
                                eos_token_ids(draft, tokenizer), pad)
    bar = (lambda **kw: progress(**{**kw, "unit": "step"})) if progress else None
    losses = trainer.fit(source, bar, items_cache={} if items_cache is None else items_cache)
    after = measure() if eval_samples else None
    metrics = {"dataset": dataset, "split": split, "samples": len(samples), "resumed": resumed,
               "optimizer_steps": trainer.step, "skipped_nonfinite": trainer.skipped_nonfinite,
               "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
               "losses": losses, "eval_before": before, "eval_after": after,
               "seconds": time.perf_counter() - start, "peak_rss_gib": peak_rss_gib()}
    osd_config = {"models": asdict(models), "teacher": asdict(settings), "distill": asdict(config),
                  "data": {"dataset": dataset, "split": split, "limit": limit, "offset": offset}}
    metrics["draft_dir"] = str(export_draft(draft, tokenizer, out, osd_config, metrics))
    return metrics


def run_eval(models: ModelConfig, drafts: list[str], settings: DecodeSettings, dataset: str, split: str, limit: int,
             k: int = 4, calibration: dict | None = None, batch_size_generate: int = 8, cache_dir=None,
             progress=None, offset: int = 0) -> dict:
    samples, _ = dataset_samples(models, dataset, split, limit, settings, offset, batch_size_generate, cache_dir,
                                 progress)
    keep_ids = special_ids(load_tokenizer(models.target))
    rows = {}
    for spec in drafts:
        master = load_model(spec, models.draft_dtype)
        copy = None
        if models.draft_quantize != "none" or models.draft_vocab:  # what serving proposes from (build.py)
            copy = serving_copy(master, models.draft_quantize, models.draft_vocab, keep_ids, models.allow_kernel_fallback)
        rows[spec] = evaluate_draft(master, samples, k, calibration, settings.max_new_tokens, copy)
    return {"dataset": dataset, "split": split, "limit": limit, "offset": offset, "teacher": asdict(settings), "k": k,
            "calibration": calibration, "drafts": rows, "peak_rss_gib": peak_rss_gib()}
