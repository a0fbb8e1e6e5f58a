"""Atomic draft checkpoints: weights (safetensors), optimizer state, version and counters.

Weights: only the trainable parameters when some are frozen (the frozen rest is the base draft every run
starts from and resumes onto), so a checkpoint of the top 4 layers of the 0.5B draft is ~0.25 GB, not 2.5.
Such a checkpoint is only right on the base it was trained on: state.json keeps a fingerprint of the weights
it does not hold, and loading it onto any other base raises CheckpointMismatch instead of mixing two drafts.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_file, save_model

from osd.bench.record import git_revision
from osd.errors import CheckpointMismatch


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
    state = {**state, "base_fingerprint": base_fingerprint(master, _names_in(tmp)), "git_revision": git_revision()}
    (tmp / "state.json").write_text(json.dumps(state, indent=2, default=str))
    master.config.save_pretrained(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def spread_indices(n: int, count: int) -> torch.Tensor:
    """`count` evenly spaced indices into n elements, first and last included (integer arithmetic: a float
    linspace rounds n - 1 up past the end once n exceeds 2**24)."""
    count = min(count, n)
    return torch.arange(count, dtype=torch.int64) * (n - 1) // max(1, count - 1)


def base_fingerprint(model, saved: set[str]) -> str:
    """What a checkpoint must be loaded onto: a hash of the parameters it does not hold (names, shapes and 64
    evenly spaced values of each, rounded to bfloat16 so a float32 and a bfloat16 copy of one base agree)."""
    digest = hashlib.sha256()
    everything = dict(model.named_parameters(remove_duplicate=False))  # tied weights under both names
    held = {everything[n].data_ptr() for n in saved if n in everything}  # a tied twin of a saved weight is held too
    for name, p in sorted(model.named_parameters()):
        if name in saved or p.data_ptr() in held:
            continue
        flat = p.detach().reshape(-1)
        picks = flat[spread_indices(flat.numel(), 64)]
        digest.update(f"{name}{tuple(p.shape)}".encode())
        digest.update(picks.to(torch.bfloat16).float().numpy().tobytes())
    return digest.hexdigest()[:16]


def _names_in(directory: Path) -> set[str]:
    with safe_open(str(directory / "draft.safetensors"), "pt") as f:
        return set(f.keys())


def checkpoint_dir(directory: str) -> Path | None:
    """The directory holding the last complete checkpoint (the .old one after a crash between two renames)."""
    for where in (Path(directory), Path(directory).with_name(Path(directory).name + ".old")):
        if (where / "state.json").exists():
            return where
    return None


def load_checkpoint(directory: str, master, optimizer=None) -> dict | None:
    """Load the weights (and the optimizer's state, when given one) into `master`; the saved state, or None.
    Raises CheckpointMismatch when `master` is not the base draft the checkpoint was trained on."""
    final = checkpoint_dir(directory)
    if final is None:
        return None
    state = json.loads((final / "state.json").read_text())
    expected, found = state.get("base_fingerprint"), base_fingerprint(master, _names_in(final))
    if expected is not None and expected != found:  # (checkpoints written before fingerprints: not checked)
        raise CheckpointMismatch(
            f"checkpoint {directory} holds only the trained part of a draft made on another base draft "
            f"(fingerprint {expected}; the draft given has {found}); give the --draft it started from "
            f"(config in {final / 'state.json'}) or another checkpoint directory")
    try:
        load_model(master, str(final / "draft.safetensors"), strict=False)  # the trainable subset, or everything
    except RuntimeError as e:  # other shapes: another architecture
        raise CheckpointMismatch(f"checkpoint {directory} does not fit the draft given: {e}") from e
    if optimizer is not None:  # None: weights only (evaluating a checkpointed draft)
        try:
            optimizer.load_state_dict(torch.load(final / "optimizer.pt", weights_only=True))
        except (ValueError, RuntimeError, KeyError):
            pass  # a different trainable set: start the optimizer afresh
    return state
