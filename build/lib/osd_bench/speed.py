"""`osd bench speed`: tokens/s of llama.cpp, transformers and osd on the same prompts, side by side in one run.

For each prompt (after a warm-up that is not counted) every arm runs back to back, so machine noise hits all
of them alike. Arms (same GGUF files, same prompts, same token counts, greedy):
  llama_cpp_target  llama-cpp-python's own `Llama.generate` with the target GGUF (what a CPU user runs today)
  llama_cpp_spec    the target GGUF verified by llama.cpp, the bundled 0.5B GGUF drafting on llama.cpp, fixed k
                    (osd's loop: llama-cpp-python has no draft-model speculation of its own)
  target_hf         transformers greedy `generate` with the dense fp32 target (--hf-baseline)
  osd_target        osd with k = 0 on llama.cpp for a GGUF target (given --target-backend auto), else its backend
  osd               osd speculative decoding: the configured draft (lookup and/or model), adaptive k
  osd_lookup        osd with the n-gram lookup proposer alone (drafting costs ~0), adaptive k
  osd_q4_target     osd with k = 0 on its own Q4_K kernel (models/q4_runner.py, same GGUF; --no-osd-q4 drops it)
  osd_q4            osd speculative on its own Q4_K kernel, a proposer of the osd arm's kind (same draft), adaptive k
  osd_q4_tree       osd_q4 with token trees (--tree N: the chain plus the recycled table's branches, propose/tree.py);
                    with --tree, osd_q4 runs chains only, so the two stand side by side
  osd_q4_recycle    osd on its own Q4_K kernel with no draft at all: trees of recycled tokens only (--tree N)
  osd_q4_learned    osd_q4 with the draft an online learner published (--learned-draft: its checkpoint directory, on
                    the same base draft), so never-trained and learned draft run side by side; give --domains and
                    --offset so the prompts are requests the learner never saw. `--learned-draft derived:<dir>`
                    runs another derived draft there instead (e.g. a longer heal beside the shipped one)
  osd_q4_vnni       osd_q4 with the same draft's int8_vnni serving copy (activations int8 too, AVX-512 VNNI:
                    models/serving_draft.py), chains, so the two serving copies stand side by side; built only when
                    --arms names it, refused on a CPU without VNNI
  osd_q4_q4draft    osd_q4 with the same draft's Q4 serving copy (4-bit on the target's kernel, models/q4_draft.py),
                    chains; built only when --arms names it
`--busy-calibration N`: N processes spin on the CPU while each osd_q4* arm calibrates (none while anything decodes),
the case of a server started beside other work: does the k policy recover from the costs it measured then?
Decode tokens/s leaves out the prompt (time to the first token for llama.cpp's loop, the prefill for osd's);
end-to-end tokens/s includes it. Outputs of every arm are compared token by token with their reference: osd_q4*
with osd_q4_target (greedy identity on that backend), every other arm with osd_target.
"""
from __future__ import annotations

import resource
import time
from collections import Counter
from dataclasses import replace

import torch
from tqdm import tqdm

from osd.build import build_system, target_backend
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.data import load_records, prompt_ids, with_context
from osd.engine import SpeculativeEngine
from osd.errors import InvalidArgument

DOMAINS = ("code", "gsm8k", "spider", "chat")
REFERENCE = {"osd_q4": "osd_q4_target", "osd_q4_target": "osd_q4_target",  # arm -> the arm its outputs must equal
             "osd_q4_learned": "osd_q4_target", "osd_q4_tree": "osd_q4_target", "osd_q4_recycle": "osd_q4_target",
             "osd_q4_vnni": "osd_q4_target", "osd_q4_q4draft": "osd_q4_target"}
SPECULATIVE_Q4 = ("osd_q4", "osd_q4_learned", "osd_q4_vnni", "osd_q4_q4draft", "osd_q4_tree", "osd_q4_recycle")


def bench_prompts(per_domain: int, split: str = "test", domains=DOMAINS, offset: int = 0) -> list[dict]:
    """per_domain records of each domain, from `offset` on (past the requests a learned draft trained on)."""
    out = []
    for name in domains:
        out += [dict(r, domain=name, prompt=with_context(r))  # Spider questions with their schema
                for r in load_records(name, split=split, limit=per_domain, offset=offset)]
    if not out:
        raise InvalidArgument(f"no benchmark prompts in {list(domains)} (split {split}, from record {offset})")
    return out


def rss_gib() -> float:
    """Peak resident memory of this process so far (GiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Timed:
    """One arm's output and timings for one prompt."""

    def __init__(self, tokens: list[int], seconds: float, prompt_seconds: float, counters=None):
        self.tokens, self.seconds, self.prompt_seconds = tokens, seconds, prompt_seconds
        self.counters = counters  # an osd arm's SpecCounters for this prompt (steps, rows, accepted, tree tokens)


def _engine_arm(engine: SpeculativeEngine, max_new: int):
    sampling = SamplingConfig(max_new_tokens=max_new)

    def run(ids):
        result = engine.generate(ids, sampling)
        return Timed(result.token_ids, result.seconds, result.prefill_seconds, result.counters)
    run.engine = engine
    return run


def _calibrated_arm(engine: SpeculativeEngine, max_new: int, busy: int = 0):
    """An osd arm whose engine measured its costs first (`calibration`: c and the verify costs, reported per arm);
    busy: that many processes spin beside the calibration (bench/neighbours.py), none beside the decoding."""
    from osd_bench.neighbours import busy_neighbours

    run = _engine_arm(engine, max_new)
    with busy_neighbours(busy):
        run.calibration = engine.calibrate()
    return run


def _arm_stats(run) -> dict:
    """What a speculative arm did overall, for the result: its counters and its calibration."""
    return {"spec_stats": run.engine.metrics.total().summary(), "calibration": run.calibration}


def llama_cpp_target_arm(gguf, threads: int, n_ctx: int, max_new: int, eos: set[int]):
    from llama_cpp import Llama

    from osd.models.llama_cpp_runner import default_threads, llama_cpp_lib

    llama_cpp_lib()
    llm = Llama(str(gguf), n_ctx=n_ctx, n_threads=threads or default_threads(), n_batch=512, verbose=False)

    def run(ids):
        out, t0, first = [], time.perf_counter(), None
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            first = first or time.perf_counter()
            if token in eos:
                break
            out.append(token)
            if len(out) >= max_new:
                break
        return Timed(out, time.perf_counter() - t0, (first or t0) - t0)
    return run


def _hf_arm(dense_target, max_new: int, eos: set[int]):
    def run(ids):
        inputs = torch.tensor([ids])
        kwargs = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=list(eos), pad_token_id=list(eos)[0],
                      temperature=None, top_p=None, top_k=None)
        t0 = time.perf_counter()
        with torch.inference_mode():
            first = dense_target(inputs).logits  # the prompt's forward alone: its time stands in for the prefill
        prompt_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = dense_target.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
        del first
        return Timed([t for t in out[0, len(ids):].tolist() if t not in eos], time.perf_counter() - t0, prompt_seconds)
    return run


def _learned_arm(system, q4_target, spec: SpeculationConfig, checkpoint: str, max_new: int, busy: int = 0):
    """osd_q4 with the draft's learned weights (a learner's checkpoint directory, on the same base draft), or with
    another derived draft (`derived:<dir or shipped name>`, e.g. one healed longer), beside the configured one."""
    from osd.build import speculative_engine
    from osd.learn.checkpoint import load_checkpoint
    from osd.models.loading import load_model

    if checkpoint.startswith("derived:"):
        learned, state = load_model(checkpoint, system.models.draft_dtype), {"version": 0}
    else:
        learned = load_model(system.models.draft, system.models.draft_dtype)
        state = load_checkpoint(checkpoint, learned)  # weights only; CheckpointMismatch on another base
    if state is None:
        raise InvalidArgument(f"no draft checkpoint in {checkpoint!r}")
    system.publish_draft(learned, name="learned", version=state["version"])
    engine = speculative_engine(system, q4_target, replace(spec, tree=0), draft="learned")  # chains, as osd_q4
    run = _calibrated_arm(engine, max_new, busy)
    run.version = state["version"]
    return run


COPY_ARMS = {"osd_q4_vnni": "int8_vnni", "osd_q4_q4draft": "q4"}  # arm -> the draft serving copy it runs


def _copy_arm(system, q4_target, spec: SpeculationConfig, max_new: int, arm: str, busy: int = 0):
    """osd_q4 with another serving copy of the configured draft (COPY_ARMS: int8_vnni, q4) in place of its own (same
    master weights), chains as osd_q4, so the two copies stand side by side."""
    from osd.build import speculative_engine
    from osd.models.tokenizer import special_ids
    from osd.models import kernels
    from osd.models.serving_draft import make_serving_draft

    quantize = COPY_ARMS[arm]
    if quantize == "int8_vnni" and not kernels.vnni_available():
        raise InvalidArgument("--arms osd_q4_vnni needs a CPU with AVX-512 VNNI (and the rows kernels built)")
    if system.models.draft_quantize == quantize:
        raise InvalidArgument(f"--arms {arm} compares the draft's {quantize} copy against its configured one, which is "
                              f"{quantize} already: give --draft-quantize int8")
    serving, vocab_ids = make_serving_draft(system.draft_master, quantize, system.models.draft_vocab,
                                            special_ids(system.tokenizer))
    system.registry.publish(quantize, serving, vocab_ids)
    engine = speculative_engine(system, q4_target, replace(spec, tree=0), draft=quantize)  # chains, as osd_q4
    return _calibrated_arm(engine, max_new, busy)


def build_arms(models: ModelConfig, spec: SpeculationConfig, max_new: int, llama_cpp: bool, hf: bool, spec_k: int,
               osd_q4: bool = True, learned_draft: str = "", copies: tuple[str, ...] = (), busy_calibration: int = 0):
    """name -> (run(prompt_ids) -> Timed), plus the osd system and what each arm added to peak RSS. copies: the
    COPY_ARMS to build too (osd_q4_vnni, osd_q4_q4draft); busy_calibration: processes spinning beside each osd_q4*
    arm's calibration."""
    from osd.models.loading import gguf_file

    busy = busy_calibration

    arms, rss, start = {}, {}, rss_gib()
    system = build_system(models, spec)
    engine = system.engine
    arms["osd_target"] = _engine_arm(SpeculativeEngine(system.target_model, system.tokenizer, None,
                                                       SpeculationConfig(k=0, adaptive=False)), max_new)
    arms["osd"] = _engine_arm(engine, max_new)
    from osd.propose.ngram import NgramProposer

    lookup = SpeculativeEngine(system.target_model, system.tokenizer, NgramProposer(engine.vocab_size),
                               SpeculationConfig(k=spec.k, adaptive=spec.adaptive))
    lookup.calibrate()
    arms["osd_lookup"] = _engine_arm(lookup, max_new)
    rss["osd (target + draft)"] = rss_gib() - start
    target_gguf = gguf_file(models.target)
    if osd_q4 and target_gguf is not None and type(system.target_model).__name__ != "Q4Runner":
        from osd.build import speculative_engine
        from osd.models.q4_runner import Q4Runner

        before = rss_gib()
        q4_target = Q4Runner(target_gguf, models.n_ctx)
        arms["osd_q4_target"] = _engine_arm(SpeculativeEngine(q4_target, system.tokenizer, None,
                                                              SpeculationConfig(k=0, adaptive=False)), max_new)
        arms["osd_q4"] = _calibrated_arm(speculative_engine(system, q4_target, replace(spec, tree=0)), max_new, busy)
        if spec.tree:
            arms["osd_q4_tree"] = _calibrated_arm(speculative_engine(system, q4_target, spec), max_new, busy)
            recycle = SpeculativeEngine(q4_target, system.tokenizer, None, SpeculationConfig(k=0, tree=spec.tree))
            arms["osd_q4_recycle"] = _calibrated_arm(recycle, max_new, busy)
        rss["osd Q4 kernel target"] = rss_gib() - before
        if learned_draft:
            arms["osd_q4_learned"] = _learned_arm(system, q4_target, spec, learned_draft, max_new, busy)
        for arm in copies:
            arms[arm] = _copy_arm(system, q4_target, spec, max_new, arm, busy)
    if learned_draft and "osd_q4_learned" not in arms:
        raise InvalidArgument("--learned-draft runs on osd's own Q4 kernel: it needs a GGUF target (not --no-osd-q4)")
    if llama_cpp and target_gguf is not None:
        from osd.models.llama_cpp_runner import LlamaCppRunner
        from osd.propose import RunnerProposer

        before = rss_gib()
        arms["llama_cpp_target"] = llama_cpp_target_arm(target_gguf, models.threads, models.n_ctx, max_new, engine.eos_ids)
        draft_gguf = gguf_file(models.draft) if models.draft else None
        if draft_gguf is not None:
            target = LlamaCppRunner(target_gguf, models.n_ctx, models.threads)
            draft = RunnerProposer(LlamaCppRunner(draft_gguf, models.n_ctx, models.threads), "llama.cpp-draft",
                                   target.vocab_size)
            spec_engine = SpeculativeEngine(target, system.tokenizer, draft, SpeculationConfig(k=spec_k, adaptive=False))
            arms["llama_cpp_spec"] = _engine_arm(spec_engine, max_new)
        rss["llama.cpp arms"] = rss_gib() - before
    if hf:
        from osd.models.loading import load_model

        before = rss_gib()
        arms["target_hf"] = _hf_arm(load_model(models.target, models.dtype), max_new, engine.eos_ids)
        rss["transformers fp32 target"] = rss_gib() - before
    return arms, system, rss


def run_speed(models: ModelConfig, spec: SpeculationConfig, per_domain: int = 2, max_new_tokens: int = 64,
              llama_cpp: bool = True, hf_baseline: bool = False, spec_k: int = 4, osd_q4: bool = True,
              learned_draft: str = "", domains=DOMAINS, offset: int = 0, only: tuple[str, ...] = (),
              busy_calibration: int = 0) -> dict:
    """only: run just these arms (the others are built but not timed); the baseline arm is always kept.
    busy_calibration: processes spinning beside each osd_q4* arm's calibration (none beside any decoding), to see
    whether the k policy recovers from costs measured on a busy machine."""
    records = bench_prompts(per_domain, domains=domains, offset=offset)  # (checked before anything loads)
    if models.target_backend == "auto" and target_backend(models) == "osd":
        models = replace(models, target_backend="llama.cpp")  # osd_target / osd on llama.cpp, osd_q4* on the Q4 kernel
    arms, system, rss = build_arms(models, spec, max_new_tokens, llama_cpp, hf_baseline, spec_k, osd_q4, learned_draft,
                                   copies=tuple(a for a in COPY_ARMS if a in only), busy_calibration=busy_calibration)
    if only:
        unknown = set(only) - set(arms)
        if unknown:
            raise InvalidArgument(f"--arms: no arm {sorted(unknown)} in this run (arms: {sorted(arms)})")
        keep = set(only) | {"llama_cpp_target" if "llama_cpp_target" in arms else "osd_target"}
        keep |= {REFERENCE[a] for a in only if a in REFERENCE} | {"osd_target"}
        arms = {name: run for name, run in arms.items() if name in keep}
    engine = system.engine
    calibration = engine.calibrate()
    warm = prompt_ids(system.tokenizer, "Write a haiku about the sea.")
    for run in arms.values():  # warm-up, not counted
        run(warm)

    totals = {name: {"tokens": 0, "seconds": 0.0, "decode_seconds": 0.0} for name in arms}
    per_prompt, mismatches = [], {name: 0 for name in arms}
    engine.metrics.reset()
    q4_engine = arms["osd_q4"].engine if "osd_q4" in arms else None
    for name in SPECULATIVE_Q4:
        if name in arms:
            arms[name].engine.metrics.reset()
            arms[name].engine.scheduler.stats.tree_shapes.clear()
    for record in tqdm(records, desc="bench speed", unit="prompt"):
        ids = prompt_ids(system.tokenizer, record["prompt"])
        row, outputs = {"id": record["id"], "domain": record["domain"], "prompt_tokens": len(ids)}, {}
        for name, run in arms.items():
            timed = run(ids)
            outputs[name] = timed.tokens
            totals[name]["tokens"] += len(timed.tokens)
            totals[name]["seconds"] += timed.seconds
            totals[name]["decode_seconds"] += timed.seconds - timed.prompt_seconds
            row[name] = {"tokens": len(timed.tokens), "seconds": round(timed.seconds, 3),
                         "prompt_seconds": round(timed.prompt_seconds, 3)}
            if timed.counters is not None:  # speculation's work for this prompt
                c = timed.counters
                row[name].update(steps=c.steps, rows=c.rows, proposed=c.proposed, accepted=c.accepted,
                                 tree_steps=c.tree_steps, tree_tokens=c.tree_tokens)
        for name, out in outputs.items():
            reference = REFERENCE.get(name, "osd_target")
            same = out == outputs[reference]
            mismatches[name] += int(not same)
            row[name][f"identical_to_{reference}"] = same
        per_prompt.append(row)
    end_to_end = {name: t["tokens"] / t["seconds"] for name, t in totals.items()}
    decode = {name: t["tokens"] / t["decode_seconds"] for name, t in totals.items()}
    base = "llama_cpp_target" if "llama_cpp_target" in arms else "osd_target"
    return {
        "config": {"models": vars(models), "spec": vars(spec), "per_domain": per_domain, "max_new_tokens": max_new_tokens,
                   "llama_cpp_spec_k": spec_k, "prompts": [r["id"] for r in records], "domains": list(domains),
                   "offset": offset, "learned_draft": learned_draft or None, "busy_calibration": busy_calibration},
        "draft_copy": {"chosen": system.models.draft_quantize,  # the copy the configured draft ran (auto resolved)
                       "seconds_per_token": system.draft_copy_seconds},  # auto's timing of each candidate, if any
        "target_backend": type(engine.target).__name__,
        "target_max_rows": getattr(engine.target, "max_rows", None),
        "llama_cpp_build": _llama_cpp_build() if llama_cpp or "LlamaCpp" in type(engine.target).__name__ else None,
        "calibration": calibration,
        "decode_tokens_per_second": decode,
        "end_to_end_tokens_per_second": end_to_end,
        "baseline": base,
        "decode_speedup_vs_baseline": {name: r / decode[base] for name, r in decode.items()},
        "end_to_end_speedup_vs_baseline": {name: r / end_to_end[base] for name, r in end_to_end.items()},
        "outputs_differing_from_osd_target": mismatches,  # osd_q4: from osd_q4_target (REFERENCE)
        "reference_arm": {name: REFERENCE.get(name, "osd_target") for name in arms},
        "osd_spec_stats": engine.metrics.total().summary(),
        "osd_q4_spec_stats": q4_engine.metrics.total().summary() if q4_engine is not None else None,
        "osd_q4_calibration": arms["osd_q4"].calibration if q4_engine is not None else None,
        "osd_q4_target_seconds_after_run": q4_engine.target_costs.by_rows() if q4_engine is not None else None,
        "trees": {name: tree_report(arms[name]) for name in ("osd_q4_tree", "osd_q4_recycle") if name in arms},
        "osd_q4_learned": {"draft_version": arms["osd_q4_learned"].version, **_arm_stats(arms["osd_q4_learned"])}
        if "osd_q4_learned" in arms else None,
        **{arm: _arm_stats(arms[arm]) if arm in arms else None for arm in COPY_ARMS},
        "peak_rss_gib": {"after_all_arms": rss_gib(), **{f"added by {k}": v for k, v in rss.items()}},
        "warmup_excluded": True,
        "per_prompt": per_prompt,
    }


def tree_report(run) -> dict:
    """What a tree arm did overall: its counters, the shapes it verified most (nodes per depth), its recycled table."""
    engine = run.engine
    shapes = engine.scheduler.stats.tree_shapes
    return {"spec_stats": engine.metrics.total().summary(), "tree_nodes": engine.tree_nodes,
            "top_shapes": [[list(shape), n] for shape, n in shapes.most_common(8)], "distinct_shapes": len(shapes),
            "recycled": engine.recycled.stats() if engine.recycled is not None else None,
            "draft_runners_up": engine.runner_up_rates.stats() if engine.runner_up_rates is not None else None,
            "calibration": getattr(run, "calibration", None)}


def work_by_domain(result: dict) -> dict[str, dict[str, dict[str, float]]]:
    """domain -> osd arm -> tokens per step (target passes), rows per step, accepted chain tokens per step and tokens
    from recycled branches per step, from the per-prompt rows."""
    sums: dict[str, dict[str, Counter]] = {}
    for row in result["per_prompt"]:
        for arm, timed in row.items():
            if isinstance(timed, dict) and "steps" in timed:
                c = sums.setdefault(row.get("domain", "all"), {}).setdefault(arm, Counter())
                c.update({key: timed[key] for key in ("tokens", "steps", "rows", "accepted", "tree_tokens")})
    return {domain: {arm: {"tokens_per_step": c["tokens"] / max(c["steps"], 1), "rows_per_step": c["rows"] / max(c["steps"], 1),
                           "accepted_per_step": c["accepted"] / max(c["steps"], 1),
                           "recycled_per_step": c["tree_tokens"] / max(c["steps"], 1)}
                     for arm, c in arms.items()} for domain, arms in sums.items()}


def decode_speedup_by_domain(result: dict) -> dict[str, dict[str, float]]:
    """domain -> arm -> decode tokens/s over the baseline arm's, from the per-prompt rows (prompt time left out)."""
    sums: dict[str, dict[str, list[float]]] = {}
    for row in result["per_prompt"]:
        for arm, timed in row.items():
            if isinstance(timed, dict):
                total = sums.setdefault(row.get("domain", "all"), {}).setdefault(arm, [0, 0.0])
                total[0] += timed["tokens"]
                total[1] += timed["seconds"] - timed["prompt_seconds"]
    base = result["baseline"]
    return {domain: {arm: (t / s) / (arms[base][0] / arms[base][1]) for arm, (t, s) in arms.items()}
            for domain, arms in sums.items()}


def _llama_cpp_build() -> str | None:
    try:
        from osd.models.llama_cpp_runner import build_info

        return build_info()
    except Exception:  # no llama-cpp-python: nothing to describe
        return None
