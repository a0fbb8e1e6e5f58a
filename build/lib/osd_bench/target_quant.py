"""`osd bench target-quant`: what int8 quantization at load (--target-quantize int8) does to a torch target.

For the test prompts of each dataset (chat template), side by side in one run, warm-up excluded:
  1. the unquantized target (as loaded, fp32 or bf16; served as osd serves it: prepacked linears, row-invariant
     kernels) decodes its greedy answer on osd's target-only path (k = 0);
  2. the int8 target (models/quantized_target.py, built from the same loaded weights) decodes its own;
  3. teacher-forced on the unquantized answer (prompt + answer in one feed; the logits at every answer position
     and at the one after it, where the answer's end was decided), both targets' logits are compared.
Reported, per dataset and overall (counts first, rates derived):
  argmax_agreement  share of those positions where the int8 argmax equals the unquantized one
  mean_kl           mean over positions of KL(unquantized || int8), nats (computed in float64)
  answer_identity   share of prompts whose int8 greedy answer equals the unquantized one, token for token
  ms_per_token      decode time per generated token of each target (prefill excluded), prompts run back to back
  weight_gib        parameters + buffers of each served model
Limitations: both targets are in memory at once (the unquantized one is the reference: a benchmark, not serving);
teacher forcing follows the unquantized answer only, so positions after a divergence measure agreement on text the
int8 target would not have written itself.
"""
from __future__ import annotations

import sys
import time

import torch

from osd.learn.losses import forward_kl

DATASETS = ("code", "gsm8k", "spider", "chat")
COUNTS = ("prompts", "identical_answers", "positions", "argmax_agree", "kl_sum", "reference_tokens",
          "reference_decode_seconds", "quantized_tokens", "quantized_decode_seconds")


def agreement(reference_logits: torch.Tensor, quantized_logits: torch.Tensor) -> dict:
    """Counts over positions: {positions, argmax_agree, kl_sum = sum of KL(reference || quantized)}. (N, V), (N, V)."""
    reference_logp = torch.log_softmax(reference_logits.double(), dim=-1)  # (N, V)
    quantized_logp = torch.log_softmax(quantized_logits.double(), dim=-1)  # (N, V)
    same = reference_logits.argmax(dim=-1) == quantized_logits.argmax(dim=-1)  # (N,)
    return {"positions": int(same.numel()), "argmax_agree": int(same.sum()),
            "kl_sum": float(forward_kl(reference_logp, quantized_logp).sum())}


def rates(counts: dict) -> dict:
    """The derived figures of summed counts (COUNTS)."""
    per = lambda a, b: counts[a] / counts[b] if counts[b] else None
    ms = lambda s, n: 1000 * counts[s] / counts[n] if counts[n] else None
    return {"argmax_agreement": per("argmax_agree", "positions"), "mean_kl": per("kl_sum", "positions"),
            "answer_identity": per("identical_answers", "prompts"),
            "reference_ms_per_token": ms("reference_decode_seconds", "reference_tokens"),
            "quantized_ms_per_token": ms("quantized_decode_seconds", "quantized_tokens")}


def teacher_forced_logits(target, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """(len(answer) + 1, V) logits predicting each answer token and the one after the answer, in one feed."""
    from osd.models.runner import as_runner

    runner = as_runner(target)
    runner.reset()
    logits = runner.feed(prompt + answer, n_logits=len(answer) + 1)
    runner.reset()
    return logits


def greedy_answer(engine, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """(answer tokens, decode seconds without the prefill) on an engine's path."""
    from osd.config import SamplingConfig

    result = engine.generate(prompt, SamplingConfig(max_new_tokens=max_new_tokens))
    return result.token_ids, result.seconds - result.prefill_seconds


def build_targets(target: str, dtype: str = "float32", allow_kernel_fallback: bool = False, model=None):
    """(unquantized, int8) served targets from one load of `target` (or the given torch `model`, left unchanged)."""
    from osd.build import build_target
    from osd.config import ModelConfig
    from osd.models.loading import load_model

    model = model if model is not None else load_model(target, dtype)
    common = dict(target=target, dtype=dtype, target_backend="torch", prepack_copy=True,
                  allow_kernel_fallback=allow_kernel_fallback)
    reference = build_target(ModelConfig(**common), model)
    quantized = build_target(ModelConfig(**common, target_quantize="int8"), model)
    return reference, quantized


def run_target_quant(target: str, datasets=DATASETS, split: str = "test", limit: int = 4, max_new_tokens: int = 64,
                     dtype: str = "float32", threads: int = 0, allow_kernel_fallback: bool = False, progress=None,
                     model=None, tokenizer=None) -> dict:
    """The comparison above; `model` / `tokenizer`: given objects instead of loading `target` (tests)."""
    from osd.build import set_threads
    from osd.config import SpeculationConfig
    from osd.data import load_records, prompt_ids
    from osd.engine import SpeculativeEngine
    from osd.errors import InvalidArgument
    from osd.models.loading import load_tokenizer
    from osd.models.quantized_target import weight_bytes

    if limit < 1 or max_new_tokens < 1 or not datasets:
        raise InvalidArgument("bench target-quant needs datasets, --limit >= 1 and --max-new-tokens >= 1")
    set_threads(threads)
    records = {name: load_records(name, split=split, limit=limit) for name in datasets}
    tokenizer = tokenizer or load_tokenizer(target)
    reference, quantized = build_targets(target, dtype, allow_kernel_fallback, model)
    target_only = SpeculationConfig(k=0, adaptive=False)
    engines = {"reference": SpeculativeEngine(reference, tokenizer, None, target_only),
               "quantized": SpeculativeEngine(quantized, tokenizer, None, target_only)}
    warm = prompt_ids(tokenizer, "Write a haiku about the sea.")
    for engine in engines.values():  # warm-up, not counted
        greedy_answer(engine, warm, min(max_new_tokens, 8))
    work = [(name, record) for name, part in records.items() for record in part]
    counts = {name: dict.fromkeys(COUNTS, 0) for name in records}
    rows = []
    for name, record in (progress(work, desc="target-quant", unit="prompt") if progress else work):
        ids = prompt_ids(tokenizer, record["prompt"])
        answer, reference_seconds = greedy_answer(engines["reference"], ids, max_new_tokens)
        own, quantized_seconds = greedy_answer(engines["quantized"], ids, max_new_tokens)
        agree = agreement(teacher_forced_logits(engines["reference"].target, ids, answer),
                          teacher_forced_logits(engines["quantized"].target, ids, answer))
        row = {"dataset": name, "id": record.get("id"), "prompt_tokens": len(ids), "identical_answers": int(own == answer),
               **agree, "reference_tokens": len(answer), "reference_decode_seconds": reference_seconds,
               "quantized_tokens": len(own), "quantized_decode_seconds": quantized_seconds}
        for key in COUNTS:
            counts[name][key] += row.get(key, 1 if key == "prompts" else 0)
        rows.append(row)
    total = {key: sum(c[key] for c in counts.values()) for key in COUNTS}
    return {"config": {"target": target, "dtype": dtype, "datasets": list(datasets), "split": split, "limit": limit,
                       "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads(),
                       "allow_kernel_fallback": allow_kernel_fallback},
            "weight_gib": {"reference": weight_bytes(reference) / 2**30, "quantized": weight_bytes(quantized) / 2**30},
            "per_dataset": {name: {**c, **rates(c)} for name, c in counts.items()},
            "overall": {**total, **rates(total)}, "warmup_excluded": True, "per_prompt": rows}


def report_target_quant(result: dict, out: str, markdown: str) -> None:
    from osd.records import emit_report, machine, redacted_command, write_result
    from osd_bench.report import table

    path = write_result(result, out)
    parts = {**result["per_dataset"], "all": result["overall"]}
    kl = lambda v: None if v is None else f"{v:.2e}"  # small: scientific notation
    rows = [[name, r["prompts"], r["positions"], r["argmax_agreement"], kl(r["mean_kl"]), r["answer_identity"],
             r["reference_ms_per_token"], r["quantized_ms_per_token"]] for name, r in parts.items()]
    t = table(rows, ["dataset", "prompts", "positions", "argmax agreement", "mean KL ref -> int8", "answers identical",
                     "ref ms/token", "int8 ms/token"])
    w, cfg, m = result["weight_gib"], result["config"], machine()
    notes = (f"KL(reference || int8) in nats per position; weights GiB: reference ({cfg['dtype']}) {w['reference']:.3f}, int8 {w['quantized']:.3f}; agreement and "
             "KL teacher-forced on the reference's greedy answers (answer positions + the one after); ms/token: "
             "decode only, osd's target-only path (k = 0), both targets back to back per prompt")
    emit_report("Target quantization (`osd bench target-quant`)",
                f"`{redacted_command(sys.argv[1:])}` target={cfg['target']!r} datasets={','.join(cfg['datasets'])} "
                f"split={cfg['split']} limit={cfg['limit']} max_new_tokens={cfg['max_new_tokens']}; machine: "
                f"{m['cpu']} ({m.get('cpu_flags')}), {m['cores']} cores, threads {cfg['threads']}", [t, notes], path,
                markdown)


def cmd_bench_target_quant(args) -> None:
    from tqdm import tqdm

    datasets = tuple(d.strip() for d in args.datasets.split(",") if d.strip())
    start = time.perf_counter()
    result = run_target_quant(args.target, datasets, args.split, args.limit, args.max_new_tokens, args.dtype,
                              args.threads, args.allow_kernel_fallback, progress=tqdm)
    result["seconds"] = round(time.perf_counter() - start, 1)
    report_target_quant(result, args.out, args.markdown)


def register(bench) -> None:
    """Add `osd bench target-quant` to the `osd bench` parser."""
    from osd.config import ModelConfig

    p = bench.add_parser("target-quant", help="int8 target (--target-quantize int8) vs the unquantized one: argmax "
                         "agreement, KL, identical greedy answers, ms/token")
    p.add_argument("--target", default=ModelConfig.target, help="a Hugging Face target (hub id, directory; a GGUF or "
                   "bundled:<name> is compared as its fp32 conversion)")
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma list of dataset names or JSONL paths")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=4, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the unquantized target's dtype")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--allow-kernel-fallback", action="store_true", help="torch's dynamic int8 where osd's kernels "
                   "cannot be built (not row-invariant)")
    p.add_argument("--out", default="benchmarks/bench-target-quant.json")
    p.add_argument("--markdown", default="BENCHMARKS.md", help="append a summary here ('' = no)")
    p.set_defaults(func=cmd_bench_target_quant)
