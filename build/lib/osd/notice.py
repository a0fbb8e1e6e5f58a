"""Startup notices: a choice osd made that changes speed or behaviour, said once per process on stderr."""
from __future__ import annotations

import sys

_said: set[str] = set()


def say(line: str) -> None:
    """Print `[osd] line` to stderr, once per process."""
    if line not in _said:
        _said.add(line)
        print(f"[osd] {line}", file=sys.stderr, flush=True)
