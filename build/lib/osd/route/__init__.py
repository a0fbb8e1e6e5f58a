"""Choosing a draft per request: features (pure), the router (policy), full-information feedback, pins.

A request pins a draft through `pinned(name)` around engine.generate (the server sets it from the request's
`osd.draft` extension field); the routed proposer reads it in `begin`.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

_PINNED: ContextVar[str | None] = ContextVar("osd_pinned_draft", default=None)


@contextmanager
def pinned(name: str | None):
    """Within this block (this thread / task), requests are served by draft `name` (None: routed)."""
    token = _PINNED.set(name)
    try:
        yield
    finally:
        _PINNED.reset(token)


def current_pin() -> str | None:
    return _PINNED.get()
