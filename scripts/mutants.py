"""Mutation check: does the suite fail when the code is wrong? Each mutant of scripts/mutants.json (one exact text
replacement in one source file, with the test files that should catch it) is applied to a copy of the working tree
in a temporary folder, never to this one, and its tests run there; a mutant whose tests still pass "survived".

    .venv/bin/python scripts/mutants.py                      # every mutant (~15 min on 2 cores)
    .venv/bin/python scripts/mutants.py --only goodput tree  # the mutants whose id contains any of these
    .venv/bin/python scripts/mutants.py --out runs/mutants.json

Exit status 1 when a mutant survived that is not marked "equivalent" (a change that cannot alter behaviour: the
entry says why). A mutant whose text is no longer in its file is reported as "stale" and fails the run too: the
list must follow the code. Run it alone on the machine: it runs pytest, CPU-heavy.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", ".venv", "benchmarks", "runs", "__pycache__", "*.egg-info", ".pytest_cache")


def run_mutant(tree: Path, mutant: dict, timeout: float) -> dict:
    path = tree / mutant["file"]
    source = path.read_text()
    if source.count(mutant["old"]) != 1:
        return {"status": "stale", "detail": f"text found {source.count(mutant['old'])} times in {mutant['file']}"}
    path.write_text(source.replace(mutant["old"], mutant["new"]))
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant["tests"]],
                              cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        lines = done.stdout.strip().splitlines()
        status = "survived" if done.returncode == 0 else "killed"
        detail = lines[-1] if lines else done.stderr.strip()[-300:]
    except subprocess.TimeoutExpired:
        status, detail = "timeout", f"tests ran past {timeout:.0f} s"
    finally:
        path.write_text(source)
    return {"status": status, "detail": detail, "seconds": round(time.perf_counter() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", default=str(ROOT / "scripts" / "mutants.json"))
    parser.add_argument("--only", nargs="*", default=[], help="run the mutants whose id contains any of these")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for one mutant's tests")
    parser.add_argument("--out", help="write every mutant's result here (JSON)")
    args = parser.parse_args()
    mutants = [m for m in json.loads(Path(args.mutants).read_text())
               if not args.only or any(word in m["id"] for word in args.only)]
    results, failing = [], []
    with tempfile.TemporaryDirectory(prefix="osd-mutants-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(ROOT, tree, ignore=SKIP, symlinks=True)
        for mutant in mutants:
            result = {"id": mutant["id"], **run_mutant(tree, mutant, args.timeout)}
            expected_survivor = result["status"] == "survived" and mutant.get("equivalent")
            if result["status"] != "killed" and not expected_survivor:
                failing.append(mutant["id"])
            results.append(result)
            note = f" (equivalent: {mutant['equivalent']})" if expected_survivor else ""
            print(f"{result['status']:9s} {mutant['id']}: {result['detail']}{note}", flush=True)
    killed = sum(r["status"] == "killed" for r in results)
    print(f"{killed} of {len(results)} mutants killed; not killed and not marked equivalent: {failing or 'none'}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
