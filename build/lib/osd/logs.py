"""Logging of the long-running commands (`osd serve`): one format for osd's lines, uvicorn's and the libraries'.

Configured once, by the command (a library never configures logging); `--log-level` sets it, uvicorn's access
and error logs included (they propagate to the same handler instead of uvicorn's own).
"""
from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
QUIET = ("httpx", "httpcore", "urllib3", "filelock")  # chatty at info/debug about their own requests


def configure_logging(level: str = "info") -> None:
    """Log at `level` (debug | info | warning | error) to stderr in FORMAT; the chatty libraries at warning."""
    logging.basicConfig(level=level.upper(), format=FORMAT, datefmt=DATE_FORMAT, force=True)
    for name in QUIET:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    logging.captureWarnings(True)


def uvicorn_options(level: str) -> dict:
    """uvicorn.Config's logging arguments: its loggers at `level`, through the handler configure_logging set up."""
    return {"log_level": level, "log_config": None}
