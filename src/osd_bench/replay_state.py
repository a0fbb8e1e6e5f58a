"""Resumable `osd replay --fast`: the replay's state on disk, so a run cut short continues where it stopped.

Saved (atomically: written beside, then renamed over) every `save_every` requests, at the stream's end and
after each offline baseline is trained: the rows measured so far, the online learner whole (trainable weights,
AdamW moments, counters, version, its random generator, both replay buffers with their cached features, the
rehearsal sample with its generator, the update history, the drift guard's best version and the requests it has
trained on), the torch random state, and the trained baselines' weights. A resumed run gives the same rows as an
uncut one (tests/learn/test_replay_resume.py). The file is a pickle (torch.save) of our own making, read with
weights_only=False: load only state files this program wrote. It refuses a state written for other stream settings
or other requests (a fingerprint of both). Baseline settings are not part of it: each trained baseline is kept with
its recipe and trained again only when the recipe changes.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from osd.errors import InvalidArgument
from osd.learn.buffer import ReplayBuffer


def fingerprint(samples: list, domains: list[str], settings: dict) -> str:
    """What a state belongs to: the settings and every request (prompt and target response ids, domain)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for s, d in zip(samples, domains):
        digest.update(json.dumps([d, list(s.prompt_ids), list(s.response_ids)]).encode())
    return digest.hexdigest()[:20]


def save_state(path: str | Path, state: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(path: str | Path | None, expected_fingerprint: str) -> dict | None:
    """The saved state, or None when there is none; InvalidArgument when it belongs to another run."""
    if not path or not Path(path).exists():
        return None
    state = torch.load(path, weights_only=False)  # our own pickle (module docstring)
    if state.get("fingerprint") != expected_fingerprint:
        raise InvalidArgument(f"{path} holds the state of a replay with other settings or requests; "
                              "give another --state path, or --fresh to start over")
    return state


def learner_state(learner) -> dict:
    return {"params": [p.detach().clone() for p in learner.params], "optimizer": learner.optimizer.state_dict(),
            "version": learner.version, "counters": dict(learner.counters), "rng": learner.rng.getstate(),
            "buffer": _buffer_state(learner.buffer), "guard_buffer": _buffer_state(learner.guard_buffer),
            "history": list(learner.history), "last_update": learner.last_update, "heldout": dict(learner.heldout),
            "versions": learner.versions.state_dict() if learner.versions is not None else None,
            "reservoir": learner.reservoir.state_dict() if learner.reservoir is not None else None,
            "average": learner.average.state_dict() if learner.average is not None else None}


@torch.no_grad()
def restore_learner(learner, state: dict) -> None:
    for p, saved in zip(learner.params, state["params"]):
        p.copy_(saved)
    learner.optimizer.load_state_dict(state["optimizer"])
    learner.version = state["version"]
    learner.counters.update(state["counters"])
    learner.rng.setstate(state["rng"])
    _restore_buffer(learner.buffer, state["buffer"])
    _restore_buffer(learner.guard_buffer, state["guard_buffer"])
    learner.history, learner.last_update = list(state["history"]), state["last_update"]
    learner.heldout = dict(state.get("heldout", {}))  # the drift guard's last same-positions agreement
    if learner.versions is not None and state["versions"] is not None:
        learner.versions.load_state_dict(state["versions"])
    if learner.reservoir is not None and state.get("reservoir") is not None:  # after the buffers: nothing evicts later
        learner.reservoir.load_state_dict(state["reservoir"])
    if learner.average is not None and state.get("average") is not None:
        learner.average.load_state_dict(state["average"])


def _buffer_state(buffer: ReplayBuffer) -> dict:
    return {"items": buffer.snapshot(), "added": buffer.added, "evicted": buffer.evicted,
            "evicted_unused": buffer.evicted_unused}


def _restore_buffer(buffer: ReplayBuffer, state: dict) -> None:
    """Re-adding the saved items in order rebuilds the same deque (neighbours never merge: they would have)."""
    buffer.clear()
    for item in state["items"]:
        buffer.add(item)
    buffer.added, buffer.evicted = state["added"], state["evicted"]
    buffer.evicted_unused = state.get("evicted_unused", 0)
