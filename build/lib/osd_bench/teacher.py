"""`osd bench teacher`: greedy teacher tokens/s, one prompt at a time vs several at once (models/q4_batch.py).

Every teacher cache (`osd draft build`, `osd replay --fast`, `osd distill`) is filled by greedy decoding of the target
on hundreds of prompts. Arms, on the same prompts and answer lengths, in one run, after one untimed warm-up each:
llama.cpp one prompt at a time (the default teacher for a GGUF), osd's Q4 kernel one at a time, and osd's Q4 kernel
with `slots` prompts decoded together. Time includes each prompt's prefill. Every osd arm's answers and top-K
distributions are checked equal to the one-at-a-time osd arm's (bitwise, by construction).
"""
from __future__ import annotations

import time

import torch

from osd.distill.teacher import greedy_answers


def _arm(runner, prompts, max_tokens, eos_ids, top_k, slots):
    greedy_answers(runner, prompts[:1], [4], eos_ids, top_k, 1).__next__()  # warm-up, untimed
    t0 = time.perf_counter()
    out = {i: (answer, dist) for i, answer, dist in greedy_answers(runner, prompts, [max_tokens] * len(prompts),
                                                                   eos_ids, top_k, slots)}
    seconds = time.perf_counter() - t0
    tokens = sum(len(a) for a, _ in out.values())
    return {"seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds}, out


def _label(slots: int) -> str:
    return "osd Q4, one prompt at a time" if slots == 1 else f"osd Q4, {slots} prompts at once"


def run_teacher(target: str, datasets: str, per_dataset: int, max_tokens: int, slots: list[int], threads: int,
                llama_cpp: bool = True, top_k: int = 64, progress=None) -> dict:
    from osd.build import set_threads
    from osd.data import load_records, prompt_ids
    from osd.models.loading import gguf_file, load_tokenizer
    from osd.models.q4_runner import Q4Runner

    set_threads(threads)
    gguf, tokenizer = gguf_file(target), load_tokenizer(target)
    records = [r for name in datasets.split(",") for r in load_records(name.strip(), "train", per_dataset)]
    prompts = [prompt_ids(tokenizer, str(r["prompt"])) for r in records]
    arms, answers = {}, {}
    q4 = Q4Runner(gguf, 2048)
    eos_ids = set(q4.eos_ids)
    plan = ([("llama.cpp, one prompt at a time", None, 1)] if llama_cpp else []) + \
           [(_label(s), q4, s) for s in sorted(set([1] + slots))]
    for label, runner, n in (progress(plan, desc="bench teacher", unit="arm") if progress else plan):
        if runner is None:
            from osd.models.llama_cpp_runner import LlamaCppRunner

            runner = LlamaCppRunner(gguf, 2048, threads)
        arms[label], answers[label] = _arm(runner, prompts, max_tokens, eos_ids, top_k, n)
        arms[label]["slots"] = n
    one = answers[_label(1)]
    for label, out in answers.items():
        if label.startswith("osd"):
            arms[label]["identical_to_one_at_a_time"] = all(
                out[i][0] == one[i][0] and torch.equal(out[i][1].ids, one[i][1].ids)
                and torch.equal(out[i][1].probs, one[i][1].probs) for i in one)
    base = arms[plan[0][0]]["tokens_per_second"]
    for arm in arms.values():
        arm["vs_first_arm"] = arm["tokens_per_second"] / base
    return {"config": {"target": target, "datasets": datasets, "per_dataset": per_dataset, "prompts": len(prompts),
                       "max_tokens": max_tokens, "slots": slots, "threads": threads, "top_k": top_k},
            "arms": arms}


def report_teacher(result: dict, out: str, markdown: str | None) -> None:
    import sys

    from osd.records import emit_report, machine, redacted_command, write_result
    from osd_bench.report import table

    path = write_result(result, out)
    rows = [[label, a["tokens"], round(a["seconds"], 1), round(a["tokens_per_second"], 1), round(a["vs_first_arm"], 2),
             {True: "yes", False: "NO"}.get(a.get("identical_to_one_at_a_time"), "-")] for label, a in result["arms"].items()]
    t = table(rows, ["teacher", "answer tokens", "seconds", "tokens/s", "vs first arm", "identical to osd one at a time"])
    c, m = result["config"], machine()
    emit_report("Teacher throughput (`osd bench teacher`)",
                f"`{redacted_command(sys.argv[1:])}`; {c['prompts']} train prompts ({c['datasets']}), greedy answers of "
                f"at most {c['max_tokens']} tokens, prefill included, warm-up excluded; machine: {m['cpu']} "
                f"({m.get('cpu_flags')}), {m['cores']} cores, threads {c['threads']}", [t], path, markdown)


def register(bench) -> None:
    from osd.config import ModelConfig

    p = bench.add_parser("teacher", help="greedy teacher tokens/s: llama.cpp / osd Q4 one prompt at a time vs several")
    p.add_argument("--target", default=ModelConfig.target, help="a Qwen2 GGUF (bundled:<name> or .gguf)")
    p.add_argument("--datasets", default="code,gsm8k,spider,support", help="train-split prompts of these")
    p.add_argument("--per-dataset", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--slots", default="4,8,16", help="prompts decoded together by the osd arms (1 always runs)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp arm")
    p.add_argument("--out", default="benchmarks/bench-teacher.json")
    p.add_argument("--markdown", default="BENCHMARKS.md", help="append a summary here ('' = no)")
    p.set_defaults(func=_cmd)


def _cmd(args) -> None:
    from tqdm import tqdm

    result = run_teacher(args.target, args.datasets, args.per_dataset, args.max_tokens,
                         [int(s) for s in args.slots.split(",") if s], args.threads, not args.no_llama_cpp,
                         progress=tqdm)
    report_teacher(result, args.out, args.markdown)
