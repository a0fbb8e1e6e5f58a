"""Recording results: JSON with config, git revision and machine; console tables; a block in a markdown file.

A leaf below both the product (checkpoints, `osd draft build` reports) and the evidence harness (osd_bench)."""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from osd.revision import git_revision


def all_cpu_flags() -> str:
    """Every flag /proc/cpuinfo gives this CPU, sorted ("" where it cannot be read): what -march=native compiles for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(set(line.split(":", 1)[1].split())))
    except OSError:
        pass
    return ""


def cpu_flags() -> str:
    """The vector-ISA flags that decide kernel speed here (AVX2, AVX-512, VNNI, AMX), as /proc/cpuinfo names them."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
              "amx_int8", "amx_bf16")
    have = set(all_cpu_flags().split())
    return " ".join(f for f in wanted if f in have) if have else "unknown"


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return {"cpu": cpu, "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "memory_gib": mem,
            "python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform()}


def redacted_command(argv: list[str]) -> str:
    """The command line with secrets (--api-key values) replaced by ***."""
    out, hide_next = ["osd"], False
    for arg in argv:
        if hide_next:
            out.append("***")
        elif arg.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(arg)
        hide_next = arg == "--api-key"
    return " ".join(out)


def write_result(result: dict, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": redacted_command(sys.argv[1:]), "git_revision": git_revision(), "machine": machine(),
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **result}
    out.write_text(json.dumps(result, indent=2, default=str))
    return out


def read_result(path: str | Path, needs: tuple[str, ...] = ()) -> dict:
    """A result JSON a benchmark command wrote, with the top-level keys `needs`; InvalidArgument names the file and
    what is wrong with it."""
    from osd.errors import InvalidArgument

    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{path}: not a result JSON ({e})") from e
    missing = [key for key in needs if not isinstance(result, dict) or key not in result]
    if missing:
        raise InvalidArgument(f"{path}: not the result this command reads (no {', '.join(missing)})")
    return result


def append_markdown(section: str, lines: list[str], path: str | Path = "BENCHMARKS.md") -> None:
    """Append a dated block under a section heading of BENCHMARKS.md."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEvery figure here was produced by the command shown with it.\n"
    block = "\n".join(lines) + "\n"
    heading = f"\n## {section}\n"
    if heading in text:
        head, rest = text.split(heading, 1)
        nxt = rest.find("\n## ")
        body, tail = (rest, "") if nxt < 0 else (rest[:nxt], rest[nxt:])
        text = head + heading + body.rstrip("\n") + "\n\n" + block + tail
    else:
        text = text.rstrip("\n") + "\n" + heading + "\n" + block
    path.write_text(text)


def emit_report(section: str, description: str, blocks: list[str], path: Path, markdown: str | Path | None,
                plot: str | None = None) -> None:
    """Print a result's blocks (tables, captions, notes) and where its files are; with `markdown`, append the same
    blocks under `section` of that file, headed by the date, the git revision and `description` (command, config,
    machine)."""
    for block in blocks:
        print(block)
    print(f"result written to {path}" + (f", plot {plot}" if plot else ""))
    if markdown:
        files = f"JSON: `{path}`" + (f", plot: `{plot}`" if plot else "")
        lines = [f"### {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} rev {git_revision()}",
                 f"{description}; {files}"]
        for block in blocks:
            lines += ["", block]
        append_markdown(section, lines, markdown)


def table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[("-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells[1:]])
