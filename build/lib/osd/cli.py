"""`osd ...`: parse -> config -> call the library. No logic here.

Flags map one-to-one onto the config dataclasses' fields (osd/config.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import entry_points

from osd import revision
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.errors import OsdError
from osd.flags import add_config_flags, config_from  # noqa: F401 - also what tests import from here


COMMANDS_GROUP = "osd.commands"  # more subcommands, registered by other packages (osd_bench) on the `osd` parser


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def cmd_generate(args) -> None:
    from osd.build import build_system
    from osd.data import prompt_ids

    system = build_system(config_from(args, ModelConfig), config_from(args, SpeculationConfig))
    sampling = config_from(args, SamplingConfig)
    system.engine.calibrate()
    ids = prompt_ids(system.tokenizer, args.prompt, chat=not args.raw)
    result = system.engine.generate(ids, sampling, on_text=lambda t: print(t, end="", flush=True))
    print()
    _print_json(result.stats)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="osd", description="Online speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate for one prompt (chat template) and print speculative stats")
    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    for cls in (ModelConfig, SpeculationConfig, SamplingConfig):
        add_config_flags(p, cls)
    p.set_defaults(func=cmd_generate)

    from osd.serve.cli import register as register_serve  # `osd serve`

    register_serve(sub)
    from osd.distill.cli import register as register_distill  # `osd target-cache`, `osd distill`, `osd eval`

    register_distill(sub)
    from osd.distill.heal_cli import register as register_draft  # `osd draft derive | heal | build | cost`

    register_draft(sub)
    for command in entry_points(group=COMMANDS_GROUP):  # `osd demo`, `osd replay`, `osd bench ...` (osd_bench)
        command.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    revision.at_start()  # what a benchmark records: the code it started with
    try:
        args.func(args)
    except OsdError as e:
        print(f"osd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("osd: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
