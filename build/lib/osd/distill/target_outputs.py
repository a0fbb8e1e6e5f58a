"""Fill and read the target-output cache: cached samples are read, missing ones generated in batches.

Resumable by construction: each finished batch is on disk before the next starts, and a later call
skips every prompt already cached. Prompts are batched by length to keep padding small.
Greedy samples of a GGUF target served by llama.cpp or osd's Q4 kernel (the default for bundled targets) come from
that runner, one prompt at a time (`serving_samples`): the target as it serves, several times faster on a CPU than
the fp32 twin in batches. They are cached under their own fingerprint (the backend's name is part of it).
"""
from __future__ import annotations

from osd.distill.cache import DecodeSettings, TargetCache, TargetSample
from osd.distill.generate import decode_batch
from osd.distill.teacher import greedy_answers


def target_samples(cache: TargetCache, target, prompts: list[list[int]], settings: DecodeSettings,
                    eos_ids: set[int], pad_id: int = 0, batch_size: int = 8, progress=None) -> list[TargetSample]:
    """Samples for `prompts` in their order; generates (and stores) only the missing ones."""
    missing = sorted({i for i, p in enumerate(prompts) if (p, settings) not in cache}, key=lambda i: len(prompts[i]))
    bar = progress(total=len(missing), desc="target cache: filling", unit="req") if progress and missing else None
    for start in range(0, len(missing), batch_size):
        chunk = missing[start : start + batch_size]
        outputs = decode_batch(target, [prompts[i] for i in chunk], settings, eos_ids, pad_id)
        for i, (response, dist) in zip(chunk, outputs):
            cache.put(TargetSample(prompts[i], response, dist, {"source": "teacher"}), settings)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return [cache.get(p, settings) for p in prompts]


def serving_samples(cache: TargetCache, runner, prompts: list[list[int]], settings: DecodeSettings, eos_ids: set[int],
                    progress=None, slots: int = 8) -> list[TargetSample]:
    """Greedy samples from a serving runner (llama.cpp: one prompt at a time; osd's Q4 kernel: `slots` prompts
    decoded together, bitwise as alone); only the missing ones, each stored as it ends."""
    missing = [i for i, p in enumerate(prompts) if (p, settings) not in cache]
    bar = progress(total=len(missing), desc="target cache: filling", unit="req") if progress and missing else None
    answers = greedy_answers(runner, [prompts[i] for i in missing], [settings.max_new_tokens] * len(missing), eos_ids,
                             settings.top_k, slots)
    for j, response, dist in answers:
        cache.put(TargetSample(prompts[missing[j]], response, dist, {"source": "teacher"}), settings)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return [cache.get(p, settings) for p in prompts]


def sampling_backend(models, settings: DecodeSettings) -> str | None:
    """The serving backend whose runner fills the cache ("llama.cpp" / "osd": a GGUF target, greedy), or None for the
    torch path (the fp32 model in batches: a Hugging Face target, --target-backend torch, or temperature > 0, which
    the one-prompt runner path does not sample)."""
    from osd.build import target_backend

    backend = target_backend(models)
    return backend if backend in ("llama.cpp", "osd") and settings.temperature == 0 else None


def cache_fingerprint(spec: str, config, backend: str | None) -> str:
    """The cache's fingerprint of a target: a serving backend's samples are tagged with its name, so they never mix
    with the fp32 twin's (or another backend's) in one cache. Limitation: the tag names the backend, not its version."""
    from osd.distill.cache import model_fingerprint

    return model_fingerprint(spec + (f"@{backend}" if backend else ""), config)


def dataset_samples(models, dataset: str, split: str | None, limit: int | None, settings: DecodeSettings,
                    offset: int = 0, batch_size: int = 8, cache_root=None, progress=None, tokenizer=None):
    """(samples, tokenizer) for a dataset's prompts (chat template); the target loads only if some are missing."""
    from transformers import AutoConfig

    from osd.data import load_records, prompt_ids
    from osd.distill.cache import default_cache_root
    from osd.build import build_target
    from osd.models.runner import eos_ids_of, eos_token_ids
    from osd.models.loading import load_model, load_tokenizer, resolve_model_dir
    from osd.models.prepack import prepack_linears

    if models.target_quantize != "none":  # the cache is keyed by the target's files: it holds the float target's outputs
        from osd.errors import InvalidArgument

        raise InvalidArgument("the target-output cache (distill, eval, replay --fast, bench train-step) holds the "
                              "unquantized target's outputs: drop --target-quantize here")
    tokenizer = tokenizer or load_tokenizer(models.target)
    records = load_records(dataset, split, limit, offset)
    prompts = [prompt_ids(tokenizer, r["prompt"]) for r in records]
    config = AutoConfig.from_pretrained(resolve_model_dir(models.target))
    backend = sampling_backend(models, settings)
    cache = TargetCache(cache_root or default_cache_root(), cache_fingerprint(models.target, config, backend))
    if backend is not None:
        runner = build_target(models) if any((p, settings) not in cache for p in prompts) else None
        samples = serving_samples(cache, runner, prompts, settings, eos_ids_of(config, tokenizer), progress)
        for s, r in zip(samples, records):
            s.meta.setdefault("id", r.get("id"))
        return samples, tokenizer
    target = None
    if any((p, settings) not in cache for p in prompts):
        target = load_model(models.target, models.dtype)
        if models.prepack_target:
            prepack_linears(target, models.allow_kernel_fallback)
    eos = eos_token_ids(target, tokenizer) if target is not None else set()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    samples = target_samples(cache, target, prompts, settings, eos, pad, batch_size, progress)
    for s, r in zip(samples, records):
        s.meta.setdefault("id", r.get("id"))
    return samples, tokenizer

