"""`osd bench speed`: tokens/s of target-only, transformers assisted generation and osd, side by side.

For each prompt (after a warm-up that is not counted) every configuration runs back to back, so
machine noise hits all of them alike:
  target_hf      transformers greedy `generate` with the dense target (the user's baseline)
  assisted_hf    transformers assisted generation, same target and the fp32 draft
  osd_target     osd with k = 0: plain target decoding on osd's kernels (prepacked target)
  osd            osd speculative decoding (int8 serving draft, adaptive or fixed k)
Outputs of every configuration are compared token by token with target_hf.
"""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from osd.build import build_system
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.data import load_records, prompt_ids
from osd.engine import SpeculativeEngine
from osd.models.kernels import rows_linear
from osd.models.loading import load_model

DOMAINS = ("code", "gsm8k", "spider", "chat")


def bench_prompts(per_domain: int, split: str = "test") -> list[dict]:
    out = []
    for name in DOMAINS:
        out += load_records(name, split=split, limit=per_domain)
    return out


def _hf_generate(model, ids, max_new, eos, assistant=None) -> list[int]:
    inputs = torch.tensor([ids])
    kwargs = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=list(eos), pad_token_id=list(eos)[0],
                  temperature=None, top_p=None, top_k=None)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    with torch.inference_mode():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
    return [t for t in out[0, len(ids):].tolist() if t not in eos]


def run_speed(models: ModelConfig, spec: SpeculationConfig, per_domain: int = 2, max_new_tokens: int = 64,
              baselines: bool = True) -> dict:
    dense_target = load_model(models.target, models.dtype)
    models.prepack_copy = True
    system = build_system(models, spec, target_model=dense_target)
    tokenizer, engine = system.tokenizer, system.engine
    target_only = SpeculativeEngine(system.target_model, tokenizer, None, SpeculationConfig(k=0, adaptive=False))
    fp32_draft = system.draft_master
    calibration = engine.calibrate()
    sampling = SamplingConfig(max_new_tokens=max_new_tokens)
    eos = engine.eos_ids

    runners = {"osd_target": lambda ids: target_only.generate(ids, sampling).token_ids,
               "osd": lambda ids: engine.generate(ids, sampling).token_ids}
    if baselines:
        runners = {"target_hf": lambda ids: _hf_generate(dense_target, ids, max_new_tokens, eos),
                   "assisted_hf": lambda ids: _hf_generate(dense_target, ids, max_new_tokens, eos, fp32_draft),
                   **runners}
    warm = prompt_ids(tokenizer, "Write a haiku about the sea.")
    for run in runners.values():  # warm-up, not counted
        run(warm)[:4]

    records = bench_prompts(per_domain)
    totals = {name: {"tokens": 0, "seconds": 0.0} for name in runners}
    per_prompt, mismatches = [], {name: 0 for name in runners}
    engine.metrics.reset()
    for record in tqdm(records, desc="bench speed", unit="prompt"):
        ids = prompt_ids(tokenizer, record["prompt"])
        row, outputs = {"id": record["id"], "prompt_tokens": len(ids)}, {}
        for name, run in runners.items():
            t0 = time.perf_counter()
            outputs[name] = run(ids)
            seconds = time.perf_counter() - t0
            totals[name]["tokens"] += len(outputs[name])
            totals[name]["seconds"] += seconds
            row[name] = {"tokens": len(outputs[name]), "seconds": round(seconds, 3)}
        reference = outputs.get("target_hf", outputs["osd_target"])
        for name, out in outputs.items():
            same = out == reference
            mismatches[name] += int(not same)
            row[name]["identical_to_reference"] = same
        per_prompt.append(row)
    spec_stats = engine.metrics.total().summary()
    rates = {name: t["tokens"] / t["seconds"] for name, t in totals.items()}
    base = rates.get("target_hf", rates["osd_target"])
    return {
        "config": {"models": vars(models), "spec": vars(spec), "per_domain": per_domain, "max_new_tokens": max_new_tokens,
                   "prompts": [r["id"] for r in records]},
        "calibration": calibration,
        "rows_linear_kernel": rows_linear() is not None,  # models/kernels.py; False: torch's kernels served
        "tokens_per_second": rates,
        "speedup_vs_target_hf": {name: r / base for name, r in rates.items()},
        "speedup_osd_vs_osd_target": rates["osd"] / rates["osd_target"],
        "outputs_differing_from_reference": mismatches,
        "osd_spec_stats": spec_stats,
        "warmup_excluded": True,
        "per_prompt": per_prompt,
    }
