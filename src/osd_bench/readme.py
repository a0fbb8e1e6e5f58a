"""`osd bench readme`: the README's current results, regenerated from the result files that benchmarks/index.json names.

The index says, per CPU kind, which result JSON backs each figure of the README's results block (and which backs each
figure a docs/ page quotes). This module computes every README figure from its file, renders one table per CPU kind
between the markers `<!-- results:start -->` and `<!-- results:end -->`, and renders benchmarks/INDEX.md from the
index. `--check` rewrites nothing and exits 1 where either file differs from what the result files give (the figure
tests run it), so a number in the README cannot drift from its file.

Figures (one function each, reading only the fields named in its docstring):
- speed: one stream, `osd bench speed` on a fresh install: decode tokens/s of osd on its Q4 kernel (`osd_q4`) over
  llama.cpp's target alone, end to end, osd's Q4 target alone; a range where the index lists several runs.
- serve: `osd bench serve-vs`: aggregate tokens/s of osd (and osd learning) over llama-server at each client count,
  and TTFT p95 of both.
- learning: `osd replay --fast`: held-out greedy acceptance of the never-trained draft and the online draft at the end
  of the stream, paired z.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

START, END = "<!-- results:start -->", "<!-- results:end -->"
ROOT = Path("benchmarks")


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def kind_of(machine: dict, kinds: dict) -> str | None:
    """The index's CPU kind whose rule a result's `machine` record meets (cpu name part, flags present and absent)."""
    flags = set(str(machine.get("cpu_flags", "")).split())
    for name, k in kinds.items():
        if k["cpu"] in str(machine.get("cpu", "")) and set(k.get("flags", [])) <= flags \
                and not set(k.get("without", [])) & flags:
            return name
    return None


def _range(values: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def speed_rows(results: list[dict]) -> list[tuple[str, str]]:
    """Reads decode_speedup_vs_baseline.{osd_q4, osd_q4_target}, end_to_end_speedup_vs_baseline.osd_q4,
    outputs_differing_from_osd_target.osd_q4, baseline (== llama_cpp_target), config.prompts."""
    for r in results:
        if r["baseline"] != "llama_cpp_target":
            raise ValueError("a speed figure's baseline must be llama.cpp's target alone")
    dec = [r["decode_speedup_vs_baseline"]["osd_q4"] for r in results]
    e2e = [r["end_to_end_speedup_vs_baseline"]["osd_q4"] for r in results]
    alone = [r["decode_speedup_vs_baseline"]["osd_q4_target"] for r in results]
    differ = sum(r["outputs_differing_from_osd_target"]["osd_q4"] for r in results)
    prompts = sum(len(r["config"]["prompts"]) for r in results)
    runs = f", {len(results)} runs" if len(results) > 1 else ""
    return [("One stream: decode tok/s vs llama.cpp (end to end)", f"**{_range(dec)}x** ({_range(e2e)}x){runs}"),
            ("... osd's Q4 target alone; outputs identical to it", f"{_range(alone)}x; {prompts - differ} of {prompts}")]


def serve_rows(r: dict) -> list[tuple[str, str]]:
    """Reads records[].{server, concurrency, aggregate_tokens_per_s, ttft_p95_s} for servers llama-server (the portable
    build), osd and osd-learning, and identity.osd."""
    by = {(x["server"], x["concurrency"]): x for x in r["records"]}
    levels = sorted(c for s, c in by if s == "osd")
    tok = lambda arm, c: by[(arm, c)]["aggregate_tokens_per_s"]
    ratio = lambda arm: "/".join(f"{tok(arm, c) / tok('llama-server', c):.2f}" for c in levels) + "x"
    same = sum(v["same"] for v in r["identity"]["osd"].values())
    of = sum(v["of"] for v in r["identity"]["osd"].values())
    at = "/".join(map(str, levels))
    rows = [(f"Serving: tok/s vs llama-server at {at} clients", f"**{ratio('osd')}**")]
    if any(s == "osd-learning" for s, _ in by):
        rows.append(("... with learning on", ratio("osd-learning")))
    rows += [("... TTFT p95, osd / llama-server (s)",
              ", ".join(f"{by[('osd', c)]['ttft_p95_s']:.1f}/{by[('llama-server', c)]['ttft_p95_s']:.1f}" for c in levels)),
             ("... greedy answers identical to osd target-only", f"{same} of {of}")]
    return rows


def learning_rows(r: dict, run: str) -> list[tuple[str, str]]:
    """Reads end_of_stream_alpha_on_heldout.<dataset>.{original, online}, heldout_vs_control.<dataset>.online.z,
    requests, config.models.draft (through osd_bench.evidence.evidence_of)."""
    from osd_bench.evidence import evidence_of

    out = []
    for e in evidence_of(r, run):
        out.append((f"Learning: held-out, {e.dataset} ({e.requests} requests)",
                    f"{e.alpha['original']:.3f} -> **{e.alpha['online']:.3f}** (z {e.z_vs_control['online']:.1f})"))
    return out


def figure_rows(entry: dict, root: Path = ROOT) -> list[tuple[str, str]]:
    results = [load(root / f) for f in entry["files"]]
    if entry["figure"] == "speed":
        return speed_rows(results)
    if entry["figure"] == "serve":
        return serve_rows(results[0])
    if entry["figure"] == "learning":
        return [row for f, r in zip(entry["files"], results) for row in learning_rows(r, Path(f).stem)]
    raise ValueError(f"unknown figure {entry['figure']!r} in the index")


def render_results(index: dict, root: Path = ROOT) -> str:
    """The README's results block: one table per CPU kind, each figure linked to its file."""
    lines = [START, f"<!-- generated by `osd bench readme` from benchmarks/index.json; edit the index, not this -->"]
    by_kind = {kind: [e for e in index["readme"] if e["kind"] == kind] for kind in index["kinds"]}
    empty = [index["kinds"][kind]["label"] for kind, entries in by_kind.items() if not entries]
    for kind, k in index["kinds"].items():
        entries = by_kind[kind]
        if not entries:
            continue
        lines += ["", f"**{k['label']}**", "", "| measure | result | file |", "|---|---|---|"]
        refs = []
        for e in entries:
            rows, stems = figure_rows(e, root), [f"[{Path(f).stem}]" for f in e["files"]]
            for i, (label, value) in enumerate(rows):  # file i beside row i; the rest beside the last row
                ref = ", ".join(stems[i:] if i == len(rows) - 1 else stems[i:i + 1])
                lines.append(f"| {label} | {value} | {ref} |")
            refs += [f"[{Path(f).stem}]: benchmarks/{f}" for f in e["files"]]
        lines += [""] + refs
    if empty:
        lines += ["", "No current result file yet: " + "; ".join(f"**{label}**" for label in empty) + "."]
    lines.append(END)
    return "\n".join(lines)


def render_index(index: dict) -> str:
    """benchmarks/INDEX.md: the topic folders, then which file backs which current figure."""
    lines = ["# Result files", "",
             "Generated by `osd bench readme` from `benchmarks/index.json` (edit that file, then rerun the command).",
             "Every benchmark command writes its JSON (and a plot where one helps) here and prints its tables; the",
             "history of the runs before this layout is in `docs/archive/BENCHMARKS-2026.md` (paths there name the",
             "files before they moved into the topic folders below).", "", "## Folders", ""]
    lines += [f"- `{name}/`: {what}" for name, what in index["folders"].items()]
    lines += ["", "## CPU kinds", ""]
    lines += [f"- `{name}`: {k['label']} (machine.cpu contains {k['cpu']!r}; flags {', '.join(k.get('flags', []))}"
              + (f"; without {', '.join(k['without'])}" if k.get("without") else "") + ")"
              for name, k in index["kinds"].items()]
    lines += ["", "## Current figures of the README (results block)", "", "| figure | CPU kind | files |",
              "|---|---|---|"]
    lines += [f"| {e['id']} ({e['figure']}) | {e['kind']} | {', '.join(f'[{f}]({f})' for f in e['files'])} |"
              for e in index["readme"]]
    lines += ["", "## Current figures of the docs pages", "", "| page | claim | CPU kind | file |", "|---|---|---|---|"]
    lines += [f"| {d['page']} | {d['claim']} | {d.get('kind', '-')} | [{d['file']}]({d['file']}) |" for d in index["docs"]]
    return "\n".join(lines) + "\n"


def replace_block(readme: str, block: str) -> str:
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise ValueError(f"the README needs one {START} ... {END} block")
    head, rest = readme.split(START, 1)
    return head + block + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="osd bench readme", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p) -> None:
    p.add_argument("--index", default="benchmarks/index.json", help="which file backs which figure")
    p.add_argument("--readme", default="README.md", help="the README whose results block is rewritten")
    p.add_argument("--index-md", default="benchmarks/INDEX.md", help="the index rendered for readers")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 where a file differs from the results")


def run(args) -> int:
    root = Path(args.index).parent  # the index's paths are relative to its folder
    index = load(args.index)
    wanted = {Path(args.readme): replace_block(Path(args.readme).read_text(), render_results(index, root)),
              Path(args.index_md): render_index(index)}
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p} differs from what {args.index} and its result files give: run `osd bench readme`",
                  file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p])
        print(f"rewrote {p}")
    print(render_results(index, root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
