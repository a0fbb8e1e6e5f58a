"""`osd serve --help` is true (issue 61 item 4): every flag has help text and the default an empty command line
gets, which are the dataclasses' own (serving's defaults are declared beside them: SpeculationConfig.serving(), ...);
the names users of vLLM and llama-server type are aliases; the learner's flags are --learn-*, the old bare names
hidden aliases; a plain `pip install .` brings what serving needs."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import sys
import tomllib
from pathlib import Path

import pytest

from osd.cli import build_parser
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.flags import HelpFormatter, config_from, shown
from osd.learn.online import LearnConfig
from osd.route.config import RouteConfig
from osd.serve.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[2]


def subcommands(parser: argparse.ArgumentParser, prefix=()) -> dict[tuple, argparse.ArgumentParser]:
    """Every (nested) subcommand's parser: ("serve",) -> parser, ("bench", "speed") -> parser, ..."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[prefix + (name,)] = sub
                found.update(subcommands(sub, prefix + (name,)))
    return found


def serve_parser() -> argparse.ArgumentParser:
    return subcommands(build_parser())[("serve",)]


def rendered(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return " ".join(HelpFormatter(parser.prog)._expand_help(action).split())


def shown_actions(parser):
    return [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


def test_every_serve_flag_has_help_and_shows_the_default_an_empty_command_line_gets(monkeypatch):
    monkeypatch.delenv("OSD_API_KEY", raising=False)
    parser = serve_parser()
    parsed = build_parser().parse_args(["serve"])
    actions = shown_actions(parser)
    assert len(actions) > 80
    for action in actions:
        text = rendered(parser, action)
        about = text.split("(default:")[0].strip()
        assert len(about) > 10, f"{action.option_strings[0]} has no help: {text!r}"
        if action.dest == "api_key":  # its default comes from the environment, and help must never print a key
            assert "(default: $OSD_API_KEY" in text
            continue
        assert f"(default: {shown(getattr(parsed, action.dest))})" in text, (action.option_strings[0], text)


def test_serve_defaults_are_the_dataclasses_serving_defaults():
    args = build_parser().parse_args(["serve"])
    assert config_from(args, ServeSettings) == ServeSettings()
    assert config_from(args, ModelConfig) == ModelConfig()
    assert config_from(args, SpeculationConfig) == SpeculationConfig.serving()
    assert config_from(args, LearnConfig) == LearnConfig.serving()
    assert config_from(args, RouteConfig) == RouteConfig.serving()
    assert args.learn and args.replicas == 0


def test_the_five_defaults_the_issue_found_wrong_are_shown_right():
    parser = serve_parser()
    for flag, value in (("--max-batch", 8), ("--learn-busy-share", 0.03), ("--learn-schedule", "background"),
                        ("--score-schedule", "background"), ("--learn-checkpoint-dir", "runs/draft-checkpoint")):
        assert f"(default: {value})" in rendered(parser, parser._option_string_actions[flag]), flag
    assert f"(default: {value})" in " ".join(parser.format_help().split())


def test_every_config_flag_of_every_subcommand_shows_its_applied_default():
    """osd generate, replay, distill, draft heal, bench ...: a flag made from a dataclass field shows the default the
    parser applies, also where a command changes it (`osd replay` runs a fixed k: --adaptive's default is False)."""
    config_fields = set()
    for cls in (ModelConfig, SpeculationConfig, SamplingConfig, LearnConfig, RouteConfig, ServeSettings):
        config_fields |= {f.name for f in dataclasses.fields(cls)}
    checked = 0
    for name, parser in subcommands(build_parser()).items():
        for action in shown_actions(parser):
            if action.dest in config_fields and "%(default)" in (action.help or ""):
                assert f"(default: {shown(action.default)})" in rendered(parser, action), (name, action.dest)
                checked += 1
    assert checked > 300
    replay = subcommands(build_parser())[("replay",)]
    adaptive = next(a for a in replay._actions if a.dest == "adaptive")
    assert "(default: False)" in rendered(replay, adaptive)


def test_every_field_of_the_served_configs_has_help_metadata():
    for cls in (ServeSettings, ModelConfig, SpeculationConfig, SamplingConfig, LearnConfig, RouteConfig):
        for f in dataclasses.fields(cls):
            assert len(f.metadata.get("help", "")) > 10, f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("argv, field, value", [
    (["--model", "some/model"], "target", "some/model"),
    (["--served-model-name", "m"], "model_name", "m"),
    (["--max-model-len", "2048"], "n_ctx", 2048),
    (["--ctx-size", "1024"], "n_ctx", 1024),
    (["--num-speculative-tokens", "3"], "k", 3),
    (["--draft-max", "5"], "k", 5),
    (["--chat-template", "t.jinja"], "chat_template", "t.jinja"),
    (["--log-level", "debug"], "log_level", "debug"),
    (["--stats-interval", "2.5"], "stats_interval", 2.5),
    (["--learn-top-k", "16"], "top_k", 16),
    (["--learn-seed", "7"], "seed", 7),
    (["--learn-batch-size", "2"], "batch_size", 2),
    (["--no-learn-guard"], "guard", False),
    (["--learn-checkpoint-dir", "ck"], "checkpoint_dir", "ck"),
])
def test_aliases_users_type(argv, field, value):
    assert getattr(build_parser().parse_args(["serve", *argv]), field) == value


def test_the_learners_old_flag_names_still_run_hidden():
    args = build_parser().parse_args(["serve", "--top-k", "16", "--seed", "7", "--batch-size", "2", "--no-guard",
                                      "--checkpoint-dir", "ck", "--busy-share", "0.5", "--schedule", "sync"])
    learn = config_from(args, LearnConfig)
    assert (learn.top_k, learn.seed, learn.batch_size, learn.guard, learn.checkpoint_dir, learn.busy_share,
            learn.schedule) == (16, 7, 2, False, "ck", 0.5, "sync")
    text = serve_parser().format_help()
    assert "--learn-top-k" in text and "--learn-batch-size" in text
    for old in ("--top-k", "--batch-size", "--seed ", "--checkpoint-dir", "--busy-share"):
        assert f" {old}" not in text.replace("--learn-", "--LEARN-"), old
    # osd replay (the harness) keeps the bare names as its own
    assert config_from(build_parser().parse_args(["replay", "--top-k", "16"]), LearnConfig).top_k == 16


def test_a_bad_value_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-level", "loud"])


def core_dependencies() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~\[ ]", dep, maxsplit=1)[0].lower().replace("-", "_") for dep in project["dependencies"]}


def test_pip_install_brings_what_serving_needs():
    """`osd serve` imports fastapi, uvicorn, pydantic and prometheus_client: core dependencies, not an extra."""
    assert {"fastapi", "uvicorn", "pydantic", "prometheus_client"} <= core_dependencies()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "serve" in project["optional-dependencies"]  # `pip install 'osd[serve]'` keeps working


# imported at module level, yet no core dependency: what brings them, or why they may be missing
NOT_CORE = {"jinja2": "torch's dependency", "starlette": "fastapi's dependency",
            "llama_cpp": "built by scripts/setup.sh; models/llama_cpp_runner.py is imported only to use it",
            "ray": "the ray extra; osd.cluster's Ray modules are imported only for --replicas"}


def test_every_module_level_import_is_a_core_dependency():
    """A fresh `pip install .` imports every module `osd ...` registers (osd_bench's commands too, in the same wheel:
    a module-level `import httpx` there once broke every command, `osd serve` included)."""
    core, missing = core_dependencies(), {}
    for path in [*(ROOT / "src" / "osd").rglob("*.py"), *(ROOT / "src" / "osd_bench").rglob("*.py")]:
        for node in ast.parse(path.read_text()).body:
            for n in [node, *(ast.walk(node) if isinstance(node, (ast.Try, ast.If)) else ())]:
                names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                    [n.module] if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module else []
                for top in {name.split(".")[0] for name in names}:
                    if top not in sys.stdlib_module_names and top not in ("osd", "osd_bench", "__future__") \
                            and top not in core and top not in NOT_CORE:
                        missing.setdefault(top, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"module-level imports that `pip install .` does not bring: {missing}"
