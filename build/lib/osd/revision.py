"""The git revision a command ran. Read once when the command starts (cli.main), so a benchmark that runs for an
hour records the code it ran even when commits land meanwhile; the revision at the end is added when it differs."""
from __future__ import annotations

import subprocess

_at_start: str | None = None


def read() -> str:
    """HEAD now, "-dirty" when tracked files differ from it."""
    try:
        run = lambda *cmd: subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=5).stdout.strip()
        rev, dirty = run("rev-parse", "--short", "HEAD"), run("status", "--porcelain", "--untracked-files=no")
        return rev + ("-dirty" if dirty else "") if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def at_start() -> str:
    """The revision when this was first called (cli.main calls it before any work)."""
    global _at_start
    if _at_start is None:
        _at_start = read()
    return _at_start


def git_revision() -> str:
    """What a result records: the revision at the start, and the one at the end when they differ."""
    start, now = at_start(), read()
    return start if now == start else f"{start} (at the end: {now})"
