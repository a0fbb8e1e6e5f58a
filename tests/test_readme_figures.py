"""The README's and the docs' figures follow benchmarks/index.json: each is what its current result file gives.

The README's results block is generated (`osd bench readme`); here it must equal what the generator computes now, so
a figure cannot drift from its file. Each docs/ figure the index lists must appear in its page as the index formats
it from its file. Old results live in docs/archive/ and are not checked.
"""
import argparse
import json
import re
import shutil
from pathlib import Path

import pytest

from osd_bench import readme

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
INDEX = json.loads((BENCH / "index.json").read_text())
DOCS = sorted(p for p in (ROOT / "docs").glob("*.md"))


def check(readme_path=ROOT / "README.md", index=BENCH / "index.json", index_md=BENCH / "INDEX.md", write=False) -> int:
    return readme.run(argparse.Namespace(index=str(index), readme=str(readme_path), index_md=str(index_md),
                                         check=not write))


def field(result: dict, path: str):
    for key in path.split("/"):
        result = result[int(key)] if isinstance(result, list) else result[key]
    return result


def test_the_readme_results_and_the_index_page_are_what_the_result_files_give():
    assert check() == 0, "run `osd bench readme` and commit README.md and benchmarks/INDEX.md"


def test_every_readme_figure_reads_existing_files_of_its_cpu_kind():
    assert {e["kind"] for e in INDEX["readme"]} <= set(INDEX["kinds"])
    assert len({e["id"] for e in INDEX["readme"]}) == len(INDEX["readme"])
    for entry in INDEX["readme"]:
        for f in entry["files"]:
            machine = json.loads((BENCH / f).read_text())["machine"]
            assert readme.kind_of(machine, INDEX["kinds"]) == entry["kind"], f
        assert readme.figure_rows(entry, BENCH), entry["id"]  # every field the figure reads is there


@pytest.mark.parametrize("doc", INDEX["docs"], ids=lambda d: f"{d['page']}:{d['claim'][:40]}")
def test_every_docs_figure_is_its_file_s_value(doc):
    result = json.loads((BENCH / doc["file"]).read_text())
    if doc.get("kind"):
        assert readme.kind_of(result["machine"], INDEX["kinds"]) == doc["kind"]
    page = " ".join((ROOT / doc["page"]).read_text().split())
    assert doc["file"] in page, f"{doc['page']} must name the file behind '{doc['claim']}'"
    for path, fmt in doc["fields"].items():
        fmt, scale = fmt if isinstance(fmt, list) else (fmt, 1)
        value = field(result, path)
        shown = fmt.format(value * scale if scale != 1 else value)
        assert shown in page, f"{doc['page']}: '{doc['claim']}' should show {shown} ({path} of {doc['file']})"


def test_a_result_file_that_changes_fails_the_check_until_the_readme_is_regenerated(tmp_path):
    """On a copy: raise osd's tokens/s at one client in the AMD serving result; the check fails, the command
    rewrites the README with the new ratio, and the check passes again."""
    bench = tmp_path / "benchmarks"
    for f in {f for e in INDEX["readme"] for f in e["files"]} | {"index.json", "INDEX.md"}:
        (bench / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(BENCH / f, bench / f)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    args = dict(readme_path=tmp_path / "README.md", index=bench / "index.json", index_md=bench / "INDEX.md")
    assert check(**args) == 0
    serve = next(e for e in INDEX["readme"] if e["figure"] == "serve")
    path = bench / serve["files"][0]
    result = json.loads(path.read_text())
    osd, server = (next(r for r in result["records"] if r["server"] == s and r["concurrency"] == 1)
                   for s in ("osd", "llama-server"))
    osd["aggregate_tokens_per_s"] = 3 * server["aggregate_tokens_per_s"]
    path.write_text(json.dumps(result))
    assert check(**args) == 1
    assert check(**args, write=True) == 0 and check(**args) == 0
    assert "**3.00/" in (tmp_path / "README.md").read_text()


def test_a_readme_without_its_markers_is_refused():
    with pytest.raises(ValueError, match="results:start"):
        readme.replace_block("# no block here\n", readme.render_results(INDEX, BENCH))


def test_the_cpu_kind_rules():
    kinds = INDEX["kinds"]
    assert readme.kind_of({"cpu": "Intel(R) Xeon(R)", "cpu_flags": "avx2 avx512f amx_tile"}, kinds) == "intel-amx"
    assert readme.kind_of({"cpu": "AMD EPYC", "cpu_flags": "avx2 fma avx512f avx512_vnni"}, kinds) == "amd-avx512"
    assert readme.kind_of({"cpu": "AMD EPYC", "cpu_flags": "avx2 fma f16c"}, kinds) == "amd-avx2"
    assert readme.kind_of({"cpu": "AMD EPYC"}, kinds) is None  # no ISA recorded: no current figure


def test_the_readme_and_the_docs_stay_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    assert [i + 1 for i, line in enumerate(lines) if len(line) > 120] == []
    assert DOCS and {p.name: len(p.read_text().splitlines()) for p in DOCS if len(p.read_text().splitlines()) > 300} == {}


def test_every_result_path_the_readme_and_the_docs_name_exists():
    for page in [ROOT / "README.md", *DOCS]:
        for path in re.findall(r"benchmarks/[\w./-]+\.(?:json|png|jsonl|md)", page.read_text()):
            assert (ROOT / path).exists(), f"{page.name} names {path}"


def test_the_readme_examples_use_the_served_name_and_port():
    from osd.config import ModelConfig
    from osd.serve.cli import default_model_name
    from osd.serve.settings import ServeSettings

    text = (ROOT / "README.md").read_text()
    name, port = default_model_name(ModelConfig().target), ServeSettings().port
    blocks = re.findall(r"```(bash|python)\n(.*?)```", text, re.S)
    curl = [b for lang, b in blocks if lang == "bash" and "curl" in b and "chat/completions" in b]
    client = [b for lang, b in blocks if lang == "python" and "OpenAI(" in b]
    assert curl and client
    for block in curl + client:
        assert f'"{name}"' in block and f"127.0.0.1:{port}/v1" in block


def test_no_benchmark_command_appends_to_a_markdown_file_by_default():
    import inspect

    from osd.cli import build_parser
    from osd.records import append_markdown

    assert inspect.signature(append_markdown).parameters["path"].default is inspect.Parameter.empty
    found = []

    def walk(parser):
        for action in parser._actions:
            if action.dest == "markdown":
                found.append((parser.prog, action.default))
            for sub in (getattr(action, "choices", None) or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
                walk(sub)

    walk(build_parser())
    assert len(found) >= 15 and [p for p, default in found if default] == []
