"""One online learner per adapter draft (drafts_multi.py): each draft learns from the traffic it served.

Every draft has its own buffer, guard, drift guard, optimizer, version history and checkpoint directory
(`<checkpoint_dir>/<draft name>/`), so one draft's checkpoint resumes without touching the others. They share
the base's weights, so every update runs with its adapter active (AdapterDrafts.use: one lock, so at most one
draft trains at a time, which on a CPU shared with decoding is what we want anyway).

`DraftLearners` hands each StepRecord and finished request to the learner of the draft that owns the request:
`owner_of(served draft)`, by default the draft that served it (`served_draft`: the routed draft's name, also
behind an n-gram lookup's "ngram+<draft>"); with a router, the owner of the request's mode (route/policy.py).
Limitations: a record of a draft that was retired meanwhile is dropped; when the owner did not serve, it learns
at the positions the serving draft proposed (mode "mismatch": where the serving draft was rejected).
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from osd.errors import CheckpointMismatch
from osd.learn.checkpoint import base_fingerprint, load_optimizer_state, swap_in
from osd.learn.online import LearnConfig, OnlineLearner


def served_draft(name: str) -> str:
    """The draft in an engine's draft label ("ngram+alpha" -> "alpha")."""
    return name.rsplit("+", 1)[-1]


class AdapterLearner(OnlineLearner):
    """OnlineLearner over one adapter of an AdapterDrafts: trainable = that adapter, publish = its serving copy."""

    def __init__(self, drafts, name: str, config: LearnConfig | None = None, engine_busy=lambda: False,
                 clock=time.monotonic):
        config = config or LearnConfig()
        root = config.checkpoint_dir
        # (vocab_swap 0: every adapter's serving copy shares one head and map, AdapterDrafts.vocab_ids)
        config = replace(config, trainable="adapter", train_layers=drafts.config.train_layers, vocab_swap=0,
                         checkpoint_dir=str(Path(root) / name) if root else "")
        self.drafts, self.name = drafts, name
        publish = lambda master, version=None: drafts.publish(name, version)
        with drafts.use(name):  # peft marks exactly this adapter trainable: the learner's parameters
            super().__init__(drafts.master, publish, config, engine_busy, clock)

    def update(self, reason: str = "manual") -> dict:
        with self.drafts.use(self.name):
            return super().update(reason)

    def save(self) -> None:
        """Atomic as save_checkpoint: adapter weights, optimizer state and state.json into <dir>.partial, fsynced,
        then swapped in by renames."""
        with self.drafts.use(self.name), self._lock:
            final = Path(self.config.checkpoint_dir)
            tmp, old = final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in self.drafts.state(self.name).items()}, str(tmp / "adapter.safetensors"))
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            state = {"draft": self.name, "version": self.version, "counters": self.counters,
                     "config": asdict(self.config), "adapter": asdict(self.drafts.config),
                     "base_fingerprint": self._base_fingerprint()}
            (tmp / "state.json").write_text(json.dumps(state, indent=2, default=str))
            swap_in(tmp, final, old)

    def resume(self) -> bool:
        """Load this draft's last checkpoint (if any) and publish it at its saved version."""
        if not self.config.checkpoint_dir:
            return False
        final = next((d for d in (Path(self.config.checkpoint_dir), Path(self.config.checkpoint_dir + ".old"))
                      if (d / "state.json").exists()), None)
        if final is None:
            return False
        state = json.loads((final / "state.json").read_text())
        with self.drafts.use(self.name), self._lock:
            if state["base_fingerprint"] != self._base_fingerprint():
                raise CheckpointMismatch(f"checkpoint {final} of draft {self.name!r} was trained on another base draft")
            self.drafts.load_state(self.name, load_file(str(final / "adapter.safetensors")))
            load_optimizer_state(self.optimizer, final / "optimizer.pt", state.get("config", {}))  # unusable: raises
            self.counters.update(state["counters"])
            self.version = self.publish(self.master, version=state["version"]).version
        return True

    def _base_fingerprint(self) -> str:
        """Of the base only: every adapter's weights are left out (the other drafts' keep changing)."""
        adapters = {n for n, _ in self.master.named_parameters() if "lora_" in n}
        return base_fingerprint(self.master, adapters)


class DraftLearners:
    """The per-draft learners, duck-typed like one OnlineLearner for the engine, the server and /metrics."""

    def __init__(self, drafts, config: LearnConfig | None = None, owner_of=served_draft):
        self.drafts, self.config, self.owner_of = drafts, config or LearnConfig(), owner_of
        self.learners: dict[str, AdapterLearner] = {}
        self.engine_busy = lambda: False
        self.turns = None  # the engine's (schedule/turns.py), from attach
        self.paused = False
        for name in drafts.names():
            self.add(name)

    def add(self, name: str) -> AdapterLearner:
        learner = AdapterLearner(self.drafts, name, self.config, engine_busy=lambda: self.engine_busy())
        learner.paused = self.paused
        learner.idle.turns = self.turns
        self.learners[name] = learner
        return learner

    def remove(self, name: str) -> None:
        learner = self.learners.pop(name, None)
        if learner is not None:
            learner.stop()

    def observe(self, record) -> None:
        learner = self.learners.get(self.owner_of(served_draft(record.draft[0])))
        if learner is not None:
            learner.observe(record)

    def after_request(self, result) -> None:
        learner = self.learners.get(self.owner_of(served_draft(result.draft[0])))
        if learner is not None:
            learner.after_request(result)

    def attach(self, engine) -> "DraftLearners":
        engine.observers.append(self.observe)
        engine.request_observers.append(self.after_request)
        self.engine_busy, self.turns = engine.busy, getattr(engine, "turns", None)
        for learner in self.learners.values():
            learner.idle.turns = self.turns
        return self

    def resume(self) -> dict[str, bool]:
        return {name: learner.resume() for name, learner in self.learners.items()}

    def start(self) -> None:
        for learner in self.learners.values():
            learner.start()

    def stop(self) -> None:
        for learner in list(self.learners.values()):
            learner.stop()

    def pause(self, timeout: float = 120.0) -> bool:
        """Every draft's learner (and one created later) pauses; see OnlineLearner.pause."""
        self.paused = True
        return all([learner.pause(timeout) for learner in list(self.learners.values())])

    def unpause(self) -> None:
        self.paused = False
        for learner in list(self.learners.values()):
            learner.unpause()

    def stats(self) -> dict:
        """Counters summed over drafts (what /metrics' learner series show); per draft in `by_draft`."""
        per = {name: learner.stats() for name, learner in sorted(self.learners.items())}
        total: dict = {}
        for stats in per.values():
            for key, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "version":
                    total[key] = total.get(key, 0) + value
        return {**total, "by_draft": per}
