"""Command-line flags from the config dataclasses (osd/config.py), one flag per field, and back.

Every subcommand module (cli.py, serve/cli.py, distill/cli.py, distill/heal_cli.py, bench/...) builds its flags here,
so none of them imports another's module.

One source: a field's help, choices and aliases live in its `metadata` (`option(default, help, ...)` writes it);
its default is the dataclass's, or the instance's when a command passes one (`osd serve` passes
`LearnConfig.serving()`: its defaults are declared beside the dataclass, never patched onto the parser). Help
renders the default the parser actually applies (`%(default)s`), so what `--help` says is what an empty command
line gets.
"""
from __future__ import annotations

import argparse
import dataclasses
import re

HELP_DEFAULT = " (default: %(default)s)"


def option(default, help: str, *, choices=None, aliases=()):
    """A dataclass field with its command-line help (and choices; aliases: other flag names users type, e.g.
    `--model` for `--target`): `k: int = option(6, "proposal length")`."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if aliases:
        meta["aliases"] = tuple(aliases)
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class HelpFormatter(argparse.HelpFormatter):
    """Shows an empty or absent default as `none` (not a blank after "default:")."""

    def _expand_help(self, action):
        if action.default is None or action.default == "":
            action = argparse.Namespace(**{**vars(action), "default": "none"})
        return super()._expand_help(action)


def shown(value) -> str:
    """How help shows a default (HelpFormatter)."""
    return "none" if value is None or value == "" else str(value)


def field_default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def flag_name(name: str, prefix: str = "") -> str:
    return "--" + prefix + name.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser, config, skip=(), prefix: str = "") -> None:
    """One flag per field of `config`: a dataclass (its defaults) or an instance of one (its values are the
    defaults). prefix: the flags are --<prefix><name> (`osd serve` names the learner's --learn-top-k, ...), and the
    bare --<name> stays as a hidden alias, so that older command lines still run."""
    cls = config if isinstance(config, type) else type(config)
    parser.formatter_class = HelpFormatter  # the parser that shows config flags shows their defaults as above
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = field_default(f) if isinstance(config, type) else getattr(config, f.name)
        names = [flag_name(f.name, prefix), *f.metadata.get("aliases", ())]
        about = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        action = _add(group, names, f, default, about)
        repeatable = "(repeatable) " if _is_list(f, default) else ""
        action.help = (repeatable + about + HELP_DEFAULT).strip()  # set after add_argument: BooleanOptionalAction
        #   (Python 3.11) appends a default of its own
        if prefix:
            _add(group, [flag_name(f.name)], f, argparse.SUPPRESS, argparse.SUPPRESS)


def _add(group, names: list[str], f: dataclasses.Field, default, about: str):
    if isinstance(default, bool) or f.type in ("bool", bool):
        return group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                  help=about)
    if _is_list(f, default):  # None: the field's own default (config_from)
        return group.add_argument(*names, dest=f.name, action="append", default=None, help=about)
    return group.add_argument(*names, dest=f.name, type=_kind(f, default), default=default,
                              choices=f.metadata.get("choices"), help=about)


def _is_list(f: dataclasses.Field, default) -> bool:
    return isinstance(default, list) or str(f.type).startswith("list")


def _kind(f: dataclasses.Field, default):
    """The flag's type: the field's annotation (`float`, `str | None`), else the default's type."""
    named = {"int": int, "float": float, "str": str}
    words = [named[w] for w in re.findall(r"\w+", str(f.type)) if w in named]
    if len(words) == 1:
        return words[0]
    return type(default) if default is not None and default is not argparse.SUPPRESS else str


def config_from(args, cls):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values = {k: v for k, v in values.items() if v is not None}
    return cls(**values)
