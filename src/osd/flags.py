"""Command-line flags from the config dataclasses (osd/config.py), one flag per field, and back.

Every subcommand module (cli.py, serve/cli.py, distill/cli.py, distill/heal_cli.py, bench/...) builds its flags here,
so none of them imports another's module.
"""
from __future__ import annotations

import argparse
import dataclasses


def add_config_flags(parser: argparse.ArgumentParser, cls, skip=()) -> None:
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, bool):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=f.metadata.get("help"))
        elif isinstance(default, list):
            group.add_argument(flag, dest=f.name, action="append", default=None, help=f"(repeatable) default {default}")
        else:
            kind = type(default) if default is not None else int
            about = f.metadata.get("help")  # a field may explain itself (config.py: field(metadata={"help", "choices"}))
            group.add_argument(flag, dest=f.name, type=kind, default=default, choices=f.metadata.get("choices"),
                               help=f"{about} (default {default})" if about else f"default {default}")


def config_from(args, cls):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values = {k: v for k, v in values.items() if v is not None}
    return cls(**values)
