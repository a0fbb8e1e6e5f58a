"""The drift guard's memory: the never-trained base and the best version so far, and what each gets right on
the rolling held-out requests (learn/guard.py `drift_action` decides; OnlineLearner acts).

Versions are kept as copies of the trainable parameters only (the frozen rest never changes), so with
train_layers = 2 on the 0.5B draft a copy is ~0.12 GB; with every layer trainable it is the whole draft
(~1.4 GB fp32): two copies (base, best) plus a temporary one while a version is measured.
A version is measured by copying its weights into the learner's master, evaluating, and copying the master's
own weights back (under the learner's lock; serving uses published snapshots, never the master).
Each version's per-position correctness on a held-out request is computed once and kept while that request
is held out. Limitation: the best version is kept in memory only (a restarted server starts with the base as
its best version).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from osd.learn.memory import tensor_bytes
from osd.learn.residual import add_difference


class VersionStore:
    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.base = _copy(params)
        self._best_slot = _copy(params)  # allocated now (learn/memory.py): remember_best copies into it
        self.best: dict | None = None  # {"version": v, "weights": [...]}; None: the base is the best so far
        self.trained_ids: set[str] = set()  # requests some optimizer step has seen: never held out again
        self._correct: dict[tuple[str, str, int], list[bool]] = {}  # (version name, request, positions) -> correct

    # --- held-out bookkeeping -----------------------------------------------------------------------
    def mark_trained(self, request_ids, keep_only=None) -> None:
        """Remember requests trained on; keep_only (ids still buffered) bounds the set."""
        self.trained_ids |= set(request_ids)
        if keep_only is not None:
            self.trained_ids &= set(keep_only)

    def correct_of(self, name: str, holdout: list, evaluate) -> list[bool]:
        """Per-position correctness of version `name` ("base" or "best") on the holdout items, in their order.

        evaluate(items) -> per-position correctness of the master as it is (acceptance_on's `correct`)."""
        weights = self.base if name == "base" or self.best is None else self.best["weights"]
        label = "base" if weights is self.base else f"v{self.best['version']}"
        key = lambda it: (label, it.request_id, len(it.positions))
        missing = [it for it in holdout if key(it) not in self._correct]
        if missing:
            with self.swapped(weights):
                flat = evaluate(missing)
            offset = 0
            for it in missing:
                self._correct[key(it)] = flat[offset : offset + len(it.positions)]
                offset += len(it.positions)
        held = {key(it)[1:] for it in holdout}
        self._correct = {k: v for k, v in self._correct.items() if k[1:] in held}  # only requests held out now
        return [c for it in holdout for c in self._correct[key(it)]]

    # --- versions -------------------------------------------------------------------------------------
    def remember_best(self, version: int) -> None:
        """The master's current weights become the best version so far."""
        _load(self._best_slot, self.params)
        self.best = {"version": version, "weights": self._best_slot}

    def restore(self, name: str) -> None:
        """Copy the best version's ("rollback") or the base's ("reset") weights into the master."""
        weights = self.best["weights"] if name == "rollback" and self.best is not None else self.base
        _load(self.params, weights)
        if weights is self.base:
            self.best = None

    def shift(self, after: list[torch.Tensor], before: list[torch.Tensor]) -> None:
        """A residual follower's reference moves with its leader (learn/residual.py): base and best get the leader's
        change too, so the guard compares the follower with the leader plus what the follower had then; the
        cached correctness of the old references is dropped."""
        add_difference(self.base, after, before)
        if self.best is not None:
            add_difference(self._best_slot, after, before)
        self._correct = {}

    @contextmanager
    def swapped(self, weights: list[torch.Tensor]):
        own = _copy(self.params)
        _load(self.params, weights)
        try:
            yield
        finally:
            _load(self.params, own)

    # --- state (a resumable replay saves it) ----------------------------------------------------------
    def state_dict(self) -> dict:
        return {"best": self.best, "trained_ids": sorted(self.trained_ids), "correct": dict(self._correct)}

    def bytes(self) -> int:
        """Memory of the kept weight copies (base and the best-version slot)."""
        return tensor_bytes(self.base + self._best_slot)

    def load_state_dict(self, state: dict) -> None:
        best = state["best"]
        if best is not None:
            _load(self._best_slot, best["weights"])
            best = {"version": best["version"], "weights": self._best_slot}
        self.best = best
        self.trained_ids = set(state["trained_ids"])
        self._correct = dict(state["correct"])


def _copy(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


@torch.no_grad()
def _load(params, weights) -> None:
    for p, w in zip(params, weights):
        p.copy_(w)
