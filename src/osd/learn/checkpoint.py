"""Atomic draft checkpoints: weights (safetensors), optimizer state, version and counters.

Weights: only the trainable parameters when some are frozen (the frozen rest is the base draft every run
starts from and resumes onto), so a checkpoint of the top 4 layers of the 0.5B draft is ~0.25 GB, not 2.5.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model, save_file, save_model

from osd.bench.record import git_revision


def save_checkpoint(directory: str, master, optimizer, state: dict) -> Path:
    """Write into a temporary dir, then swap it in: a crash never leaves a half-written checkpoint."""
    final = Path(directory)
    tmp, old = final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    params = dict(master.named_parameters())
    if all(p.requires_grad for p in params.values()):
        save_model(master, str(tmp / "draft.safetensors"))  # handles tied weights
    else:
        save_file({n: p.detach().contiguous() for n, p in params.items() if p.requires_grad}, str(tmp / "draft.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({**state, "git_revision": git_revision()}, indent=2, default=str))
    master.config.save_pretrained(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(directory: str, master, optimizer=None) -> dict | None:
    """Load the weights (and the optimizer's state, when given one) into `master`; the saved state, or None."""
    final = Path(directory)
    if not (final / "state.json").exists():
        old = final.with_name(final.name + ".old")  # crash between the two renames
        if not (old / "state.json").exists():
            return None
        final = old
    load_model(master, str(final / "draft.safetensors"), strict=False)  # the trainable subset, or everything
    if optimizer is not None:  # None: weights only (evaluating a checkpointed draft)
        try:
            optimizer.load_state_dict(torch.load(final / "optimizer.pt", weights_only=True))
        except (ValueError, RuntimeError, KeyError):
            pass  # a different trainable set: start the optimizer afresh
    return json.loads((final / "state.json").read_text())
