"""Atomic draft checkpoints: weights (safetensors), optimizer state, version and counters.

Weights: only the trainable parameters when some are frozen (the frozen rest is the base draft every run
starts from and resumes onto), so a checkpoint of the top 4 layers of the 0.5B draft is ~0.25 GB, not 2.5.
Such a checkpoint is only right on the base it was trained on: state.json keeps a fingerprint of the weights
it does not hold, and loading it onto any other base raises CheckpointMismatch instead of mixing two drafts.
An optimizer state that cannot be read or does not fit the parameters raises OptimizerStateError (never a
silent fresh start).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_file, save_model

from osd.revision import git_revision
from osd.errors import CheckpointMismatch, OptimizerStateError

PAUSE_ENV = "OSD_TEST_CHECKPOINT_PAUSE"  # test hook (tests/serve/test_real_learner.py): see _pause_if_asked


def swap_in(tmp: Path, final: Path, old: Path, between_renames=lambda: None) -> None:
    """Fsync every file of the complete directory `tmp` and `tmp` itself, then make it `final` by renames (the
    previous `final` goes to `old` in between, removed at the end) and fsync the parent: a crash leaves either the
    previous or the new directory whole (checkpoint_dir also finds `old`)."""
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        between_renames()
    tmp.rename(final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(directory: str, master, optimizer, state: dict, extra: dict | None = None,
                    frozen: tuple[str, ...] = ()) -> Path:
    """Atomic: write every file into <dir>.partial and fsync it, then swap the directory in by renames (and fsync
    the parent). A crash at any point (kill -9, power loss) leaves the last complete checkpoint loadable: <dir>,
    or <dir>.old between the two renames (checkpoint_dir finds it). extra: name -> tensors (or dicts / lists of them), saved as <name>.pt
    (load_extra reads one back). frozen: names of frozen parameters saved beside the trainable ones (an LM head whose
    map the learner swapped, learn/vocab.py: load_checkpoint puts it and the config's map back)."""
    final = Path(directory)
    tmp, old = final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    params = dict(master.named_parameters())
    if all(p.requires_grad for p in params.values()):
        save_model(master, str(tmp / "draft.safetensors"))  # handles tied weights
    else:
        save_file({n: p.detach().contiguous() for n, p in params.items() if p.requires_grad or n in frozen},
                  str(tmp / "draft.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    for name, value in (extra or {}).items():
        torch.save(value, tmp / f"{name}.pt")
    _pause_if_asked("files")
    state = {**state, "base_fingerprint": base_fingerprint(master, _names_in(tmp)), "git_revision": git_revision()}
    (tmp / "state.json").write_text(json.dumps(state, indent=2, default=str))
    master.config.save_pretrained(tmp)
    swap_in(tmp, final, old, lambda: _pause_if_asked("renames"))
    return final


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pause_if_asked(stage: str, max_seconds: float = 300.0) -> None:
    """Test hook, inert unless $OSD_TEST_CHECKPOINT_PAUSE names a file that exists and holds `stage` ("files":
    new files written, nothing swapped yet; "renames": the old checkpoint moved to .old, the new one not yet in
    place). Then the write announces itself by creating <file>.entered and sleeps until the file is removed, so a
    test can kill -9 the process at exactly that point."""
    flag = os.environ.get(PAUSE_ENV)
    if not flag or not os.path.exists(flag) or Path(flag).read_text().strip() != stage:
        return
    Path(flag + ".entered").write_text(stage)
    deadline = time.monotonic() + max_seconds
    while os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)


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


def saved_state(directory: str) -> dict | None:
    """The state.json of the last complete checkpoint (version, counters, config, ...), or None; loads nothing."""
    final = checkpoint_dir(directory)
    return json.loads((final / "state.json").read_text()) if final is not None else None


def load_checkpoint(directory: str, master, optimizer=None) -> dict | None:
    """Load the weights (and the optimizer's state, when given one) into `master`; the saved state, or None.
    Raises CheckpointMismatch when `master` is not the base draft the checkpoint was trained on, and
    OptimizerStateError (after the weights were loaded: do not train on) when the optimizer state is unusable."""
    final = checkpoint_dir(directory)
    if final is None:
        return None
    state = json.loads((final / "state.json").read_text())
    names = _names_in(final)
    expected, found = state.get("base_fingerprint"), base_fingerprint(master, names)
    if expected is not None and expected != found:  # (checkpoints written before fingerprints: not checked)
        raise CheckpointMismatch(
            f"checkpoint {directory} holds only the trained part of a draft made on another base draft "
            f"(fingerprint {expected}; the draft given has {found}); give the --draft it started from "
            f"(config in {final / 'state.json'}) or another checkpoint directory")
    try:
        load_model(master, str(final / "draft.safetensors"), strict=False)  # the trainable subset, or everything
    except RuntimeError as e:  # other shapes: another architecture
        raise CheckpointMismatch(f"checkpoint {directory} does not fit the draft given: {e}") from e
    _load_vocab_map(final, master, names)
    if optimizer is not None:  # None: weights only (evaluating a checkpointed draft)
        load_optimizer_state(optimizer, final / "optimizer.pt", state.get("config", {}))
    return state


def _load_vocab_map(final: Path, master, names: set[str]) -> None:
    """A checkpoint that holds the LM head (its map was swapped, learn/vocab.py) gives the map its config saved."""
    from osd.learn.vocab import head_name
    from osd.models.vocab_map import CONFIG_KEY, set_vocab_ids, vocab_ids_of

    name = head_name(master)
    if vocab_ids_of(master) is None or name is None or name not in names:
        return
    saved = json.loads((final / "config.json").read_text()).get(CONFIG_KEY)
    if saved is not None:
        set_vocab_ids(master, torch.as_tensor(saved, dtype=torch.long))


def load_extra(directory: str, name: str):
    """A file that save_checkpoint's `extra` wrote into the last complete checkpoint, or None when it has none."""
    final = checkpoint_dir(directory)
    path = None if final is None else final / f"{name}.pt"
    return torch.load(path, weights_only=True) if path is not None and path.exists() else None


def load_optimizer_state(optimizer, path: Path, config: dict) -> None:
    """Load a saved optimizer state, or raise OptimizerStateError saying which file and why (unreadable; other
    parameter groups or counts; moments shaped unlike the parameters). config: the run's saved config, to name
    the settings it was trained with."""
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as e:  # missing, truncated or corrupt: torch raises OSError, RuntimeError, EOFError, pickle errors
        raise OptimizerStateError(f"cannot read the optimizer state {path}: {type(e).__name__}: {e}") from e
    settings = ", ".join(f"{k}={config[k]}" for k in ("trainable", "train_layers", "lora_rank") if k in config)
    hint = (f"the checkpoint was trained with {settings or 'other settings'} (its state.json): resume with the same "
            "settings, or give another checkpoint directory")
    try:
        _check_moment_shapes(optimizer, saved)
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise OptimizerStateError(f"the optimizer state {path} does not fit the parameters being trained ({e}); "
                                  f"{hint}") from e


def _check_moment_shapes(optimizer, saved: dict) -> None:
    """load_state_dict checks only the parameter counts; moments of another shape would fail at the next step."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, moments in saved.get("state", {}).items():
        index = int(index)
        if index >= len(params):
            raise ValueError(f"state for parameter {index}, but only {len(params)} parameters train")
        for name, value in moments.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != params[index].shape:
                raise ValueError(f"{name} of parameter {index} has shape {tuple(value.shape)}, "
                                 f"the parameter {tuple(params[index].shape)}")
