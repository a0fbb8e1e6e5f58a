"""`osd demo`: the main job on the bundled pair. A few real prompts, target-only vs osd, with stats."""
from __future__ import annotations

from osd_bench.report import table
from osd.build import build_system
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.data import load_records, prompt_ids, with_context
from osd.engine import SpeculativeEngine

DEMO = (("code", 0), ("gsm8k", 0), ("spider", 0), ("chat", 3))


def run_demo(models: ModelConfig, spec: SpeculationConfig, max_new_tokens: int = 48) -> None:
    print(f"[osd] loading target {models.target} and draft {models.draft} ...", flush=True)
    system = build_system(models, spec)
    engine = system.engine
    target_only = SpeculativeEngine(system.target_model, system.tokenizer, None, SpeculationConfig(k=0, adaptive=False))
    cal = engine.calibrate()
    print(f"[osd] measured: draft/target cost c = {cal['c']:.3f}; verifying k+1 tokens costs "
          + ", ".join(f"{v:.2f}" for v in cal["verify_cost"]) + " x one token", flush=True)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens)
    rows = []
    for name, index in DEMO:
        record = load_records(name, split="test", limit=index + 1)[index]
        prompt = with_context(record)
        ids = prompt_ids(system.tokenizer, prompt)
        print(f"\n=== {record['id']} ({record['domain']}): {prompt[:300]!r}")
        plain = target_only.generate(ids, sampling)
        spec_result = engine.generate(ids, sampling)
        print(spec_result.text)
        s = spec_result.stats
        rows.append([record["id"], plain.stats["wall_tokens_per_second"], s["wall_tokens_per_second"],
                     s["wall_tokens_per_second"] / plain.stats["wall_tokens_per_second"], s["alpha"], s["tokens_per_step"],
                     "yes" if plain.token_ids == spec_result.token_ids else "NO"])
    print()
    print(table(rows, ["prompt", "target-only tok/s", "osd tok/s", "speedup", "alpha", "tokens/step", "same output"]))
