"""Atomic draft checkpoints: weights (safetensors), optimizer state, version and counters."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from osd.bench.record import git_revision


def save_checkpoint(directory: str, master, optimizer, state: dict) -> Path:
    """Write into a temporary dir, then swap it in: a crash never leaves a half-written checkpoint."""
    final = Path(directory)
    tmp, old = final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(master, str(tmp / "draft.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({**state, "git_revision": git_revision()}, indent=2, default=str))
    master.config.save_pretrained(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(directory: str, master, optimizer) -> dict | None:
    final = Path(directory)
    if not (final / "state.json").exists():
        old = final.with_name(final.name + ".old")  # crash between the two renames
        if not (old / "state.json").exists():
            return None
        final = old
    load_model(master, str(final / "draft.safetensors"), strict=False)
    try:
        optimizer.load_state_dict(torch.load(final / "optimizer.pt", weights_only=True))
    except (ValueError, RuntimeError, KeyError):
        pass  # a different trainable set: start the optimizer afresh
    return json.loads((final / "state.json").read_text())
