"""`osd replay`: replay a prompt stream through the online system (live mode: real decoding).

Per request it records alpha, tokens per step, tokens/s and the draft version; in the same run a
static copy of the original draft can serve the same stream side by side (--baseline) so both
curves come from one machine state. Output: JSON, a PNG of moving-average alpha vs requests, a table.
"""
from __future__ import annotations

from osd.bench.plots import domain_boundaries, plot_alpha_curves
from osd.build import attach_learner, build_system
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.data import load_records, prompt_ids
from osd.engine import SpeculativeEngine
from osd.learn.online import LearnConfig
from osd.propose import DraftModelProposer


def parse_stream(spec: str, split: str, per_segment: int) -> list[dict]:
    """'gsm8k' or 'gsm8k,spider,code' (a sharp shift: per_segment requests of each, in order)."""
    out = []
    for name in spec.split(","):
        out += load_records(name.strip(), split=split or None, limit=per_segment)
    return out


def run_replay(models: ModelConfig, spec: SpeculationConfig, learn: LearnConfig, stream: str, split: str,
               per_segment: int, max_new_tokens: int, baseline: bool = True, progress=None,
               target_only: bool = False) -> dict:
    system = build_system(models, spec)
    system.engine.calibrate()
    static = None
    if baseline:  # the original draft, never updated, served on the same stream for comparison

        system.publish_draft(name="static")
        static = SpeculativeEngine(system.target_model, system.tokenizer,
                                   DraftModelProposer(system.registry, "static", system.engine.vocab_size), spec)
        static.set_adaptive(False)  # fixed k: alpha comparable to online
    plain = SpeculativeEngine(system.target_model, system.tokenizer, None, SpeculationConfig(k=0, adaptive=False)) \
        if target_only else None
    system.engine.set_adaptive(False)  # the replay measures acceptance at fixed k
    learner = attach_learner(system, learn)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens)
    records = parse_stream(stream, split, per_segment)
    rows = []
    iterator = progress(records) if progress else records
    for i, record in enumerate(iterator):
        ids = prompt_ids(system.tokenizer, record["prompt"])
        result = system.engine.generate(ids, sampling)
        s = result.stats
        row = {"i": i, "id": record["id"], "domain": record["domain"], "draft_version": result.draft[1],
               "alpha": s["alpha"], "tokens_per_step": s["tokens_per_step"], "tokens_per_second": s["wall_tokens_per_second"]}
        if plain is not None:  # the target alone, same request, same machine state
            row["target_only_tokens_per_second"] = plain.generate(ids, sampling).stats["wall_tokens_per_second"]
        if static is not None:
            b = static.generate(ids, sampling).stats
            row.update(static_alpha=b["alpha"], static_tokens_per_step=b["tokens_per_step"],
                       static_tokens_per_second=b["wall_tokens_per_second"])
        rows.append(row)
        if progress and hasattr(iterator, "set_postfix"):
            iterator.set_postfix(alpha=f"{row['alpha'] or 0:.2f}", v=row["draft_version"])
    learner.stop()
    return {"config": {"models": vars(models), "spec": vars(spec), "learn": vars(learn), "stream": stream, "split": split,
                       "per_segment": per_segment, "max_new_tokens": max_new_tokens, "target_only": target_only},
            "requests": rows, "learner": learner.stats(), "metrics_by_draft_version": system.engine.metrics.snapshot()}


def plot_replay(result: dict, path: str, window: int = 10) -> str | None:
    rows = result["requests"]
    curves = {"online (osd)": [r["alpha"] or 0 for r in rows]}
    if rows and "static_alpha" in rows[0]:
        curves["original draft (static)"] = [r["static_alpha"] or 0 for r in rows]
    return plot_alpha_curves(curves, domain_boundaries(rows), f"osd replay: {result['config']['stream']}", "alpha",
                             path, window)
