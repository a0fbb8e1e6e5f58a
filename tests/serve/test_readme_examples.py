"""The README's serving examples, run as written against the real `osd serve` (issue 61): its curl block through a
shell and its `openai` block through Python, on the tiny pair served under the README's model name. Only the port
differs (8000 may be taken here): the blocks' `127.0.0.1:8000` is pointed at the test server's port, nothing else."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_tiny_pair
from osd_process import has_curl, osd_serve, tiny_pair_args

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"```(bash|python)\n(.*?)```", re.S)


def serving_blocks() -> tuple[str, str]:
    """(the curl block, the openai block) of the README's "Serve" section."""
    text = README.read_text()
    section = text[text.index("## Serve\n"): text.index("### Request parameters")]
    blocks = BLOCK.findall(section)
    curl = next(body for lang, body in blocks if lang == "bash" and body.lstrip().startswith("curl"))
    python = next(body for lang, body in blocks if lang == "python" and "from openai import OpenAI" in body)
    return curl, python


def served_name() -> str:
    """The model name the README's examples send (and says `osd serve` reports)."""
    curl, python = serving_blocks()
    names = set(re.findall(r'"model": "([^"]+)"', curl)) | set(re.findall(r'model="([^"]+)"', python))
    assert len(names) == 1, f"the README's examples name {names}: one served name expected"
    return names.pop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme-pair")
    save_tiny_pair(root, draft_layers=1)
    args = tiny_pair_args(root) + ["--served-model-name", served_name(), "--default-max-tokens", "8"]
    with osd_serve(args, log=tmp_path_factory.mktemp("readme-log") / "serve.log") as s:
        yield s


def on_port(block: str, url: str) -> str:
    assert "http://127.0.0.1:8000" in block
    return block.replace("http://127.0.0.1:8000", url)


def test_the_examples_name_the_model_osd_serve_reports_for_the_bundled_target():
    from osd.config import ModelConfig
    from osd.serve.cli import default_model_name

    assert served_name() == default_model_name(ModelConfig.target)


@pytest.mark.skipif(not has_curl(), reason="curl is not installed")
def test_the_curl_example_runs_as_written(server):
    curl, _ = serving_blocks()
    out = subprocess.run(["bash", "-c", on_port(curl, server.url)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["model"] == served_name() and reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] > 0


def test_the_openai_example_runs_as_written(server, tmp_path):
    _, python = serving_blocks()
    script = tmp_path / "example.py"
    script.write_text(on_port(python, server.url))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    answer, streamed = out.stdout.rstrip("\n").rsplit("\n", 1) if "\n" in out.stdout.rstrip("\n") else ("", "")
    assert answer.strip() and streamed.strip(), out.stdout  # the reply printed, then the stream's text on one line
