"""`osd eval` results -> console table, JSON and a BENCHMARKS.md block."""
from __future__ import annotations

import sys

from osd.records import emit_report, machine, redacted_command, write_result
from osd.records import table

COLUMNS = [("alpha greedy", "alpha_greedy"), ("tokens/step greedy", "tokens_per_step_greedy"),
           ("alpha T=1", "alpha_sampling_t1"), ("implied speedup greedy", "implied_speedup_greedy"),
           ("implied speedup T=1", "implied_speedup_sampling_t1")]


def eval_table(result: dict) -> str:
    """One row per draft; a `copy` column when serving copies were measured (the float master otherwise)."""
    copies = any("serving_copy" in row for row in result["drafts"].values())
    rows = [[name] + ([row.get("serving_copy", "none")] if copies else []) + [row.get(key) for _, key in COLUMNS]
            for name, row in result["drafts"].items()]
    return table(rows, ["draft"] + (["copy"] if copies else []) + [c for c, _ in COLUMNS])


def confidence_table(result: dict) -> str:
    """Per draft: greedy agreement where the target's top-1 probability is low / middling / high (share of positions)."""
    first = next(iter(result["drafts"].values()))["by_target_confidence"]  # the same positions for every draft
    rows = [[name] + [b["agreement"] for b in row["by_target_confidence"]] for name, row in result["drafts"].items()]
    shares = ", ".join(f"{b['bucket']} {b['share']:.2f}" for b in first)
    return (table(rows, ["draft"] + [f"agreement, target top-1 in {b['bucket']}" for b in first])
            + f"\n\nshare of positions per bucket: {shares}")


def draft_confidence_table(result: dict) -> str:
    """Per draft and bucket of its own top-1 probability: the share of positions there and its agreement."""
    rows = [[name, b["bucket"], b["share"], b["agreement"]] for name, row in result["drafts"].items()
            for b in row.get("by_draft_confidence", [])]
    return table(rows, ["draft", "draft top-1 in", "share", "agreement"])


def report_eval(result: dict, out: str, markdown: str) -> None:
    path = write_result(result, out)
    t = eval_table(result) + "\n\n" + confidence_table(result) + "\n\n" + draft_confidence_table(result)
    cal = result.get("calibration")
    notes = (f"{result['dataset']} {result['split']} first {result['limit']} prompts, k={result['k']}, "
             f"target greedy outputs, max_new_tokens={result['teacher']['max_new_tokens']}; implied speedup = "
             f"E[tokens/step] / (k*c + verify cost) at the best k, c={cal['c']:.3f} from {cal['source']}" if cal else
             "no calibration found: implied speedups omitted")
    m = machine()
    emit_report("Draft acceptance (`osd eval`)",
                f"`{redacted_command(sys.argv[1:])}`; machine: {m['cpu']}, {m['cores']} cores", [t, notes], path, markdown)
