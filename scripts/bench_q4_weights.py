"""Does the Q4 target decode faster from weights read into memory than from the memory-mapped cache file?

Both arms load the same cache file (~/.cache/osd/q4) into a Q4Runner; the same prompts are decoded greedily by
each (k = 0, no draft), alternating arm order over rounds, one warm-up request per arm not counted. Decode
tokens/s excludes the prompt's prefill. Writes JSON and prints its table (--markdown FILE: also appends it).

    python scripts/bench_q4_weights.py --rounds 3 --prompts 3 --max-new-tokens 48
"""
from __future__ import annotations

import argparse

from osd.records import emit_report, machine, write_result
from osd_bench.report import table
from osd.config import SamplingConfig
from osd.data import load_records, prompt_ids
from osd.engine import SpeculativeEngine
from osd.models.loading import gguf_file, load_tokenizer
from osd.models.q4_runner import Q4Runner


def decode_rate(engine, ids, sampling) -> float:
    results = [engine.generate(i, sampling) for i in ids]
    return sum(len(r.token_ids) - 1 for r in results) / sum(r.seconds - r.prefill_seconds for r in results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="bundled:qwen2.5-coder-1.5b")
    p.add_argument("--prompts", type=int, default=3, help="code test prompts per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", default="benchmarks/kernel/q4-weights-mmap-vs-read.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    args = p.parse_args(argv)
    gguf = gguf_file(args.target)
    tokenizer = load_tokenizer(args.target)
    ids = [prompt_ids(tokenizer, r["prompt"]) for r in load_records("code", split="test", limit=args.prompts)]
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
    engines = {arm: SpeculativeEngine(Q4Runner(gguf, mmap=arm == "mmap"), tokenizer, None) for arm in ("mmap", "read")}
    for engine in engines.values():
        engine.generate(ids[0], sampling)  # warm-up, not counted
    rates = {arm: [] for arm in engines}
    for r in range(args.rounds):
        for arm in (("mmap", "read") if r % 2 == 0 else ("read", "mmap")):
            rates[arm].append(decode_rate(engines[arm], ids, sampling))
    mean = {arm: sum(v) / len(v) for arm, v in rates.items()}
    result = {"config": vars(args), "decode_tokens_per_second": rates, "mean": mean,
              "read_over_mmap": mean["read"] / mean["mmap"]}
    path = write_result(result, args.out)
    rows = [[arm, *[round(x, 2) for x in rates[arm]], mean[arm]] for arm in ("mmap", "read")]
    t = table(rows, ["weights", *[f"round {i}" for i in range(args.rounds)], "mean decode tok/s"])
    emit_report("Q4 weights: memory-mapped or read (`scripts/bench_q4_weights.py`)",
                f"`python scripts/bench_q4_weights.py --rounds {args.rounds} --prompts {args.prompts} --max-new-tokens "
                f"{args.max_new_tokens}`, target {args.target}, k = 0, greedy, arm order alternating by round; machine: "
                f"{machine()['cpu']} ({machine()['cpu_flags']}), {machine()['cores']} cores",
                [t, f"read / mmap: {result['read_over_mmap']:.2f}x"], path, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
