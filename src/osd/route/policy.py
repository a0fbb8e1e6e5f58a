"""The router: which draft serves a request, decided before decoding from the prompt's features.

Per draft d a linear predictor of its acceptance on a request, score_d(x) = w_d . x, learned online by
normalised least mean squares (NLMS: w_d += lr (r_d - w_d . x) x / |x|^2), which tracks drafts whose
acceptance changes as they learn. Feedback is full-information where it can be (every draft's acceptance on
a finished request, route/feedback.py), so the router learns about drafts that did not serve.

A decision, in order:
1. pinned: the request names a draft (unknown name -> DraftNotFound);
2. explore: with probability `explore`, but never past `explore` x (routed requests so far), a uniformly
   random other draft (so a draft the router passes over still sees some of every traffic and can improve);
3. routed: the best predicted draft, when it leads the others by more than `margin`;
4. cold: otherwise (ties: all drafts start equal) the draft whose served traffic is most similar (cosine to
   its running centroid), or, when the request is unlike all of them, a draft that has served nothing yet.
   This online leader clustering breaks the symmetry of drafts created equal: each mode of the traffic
   claims its own draft, which then learns it, and the scores take over.
`route` decides without side effects; `commit` (after the request was served) counts it and moves the
centroid, so warm-up requests (engine.calibrate) leave no trace.
Limitation: linear in the features, so a draft's niche must be linearly separable in the hashed n-grams.
"""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import torch

from osd.errors import DraftNotFound, InvalidArgument
from osd.route.config import RouteConfig

REASONS = ("pinned", "explore", "routed", "cold")


@dataclass
class Decision:
    draft: str
    reason: str  # one of REASONS
    scores: dict[str, float]  # predicted acceptance per draft
    features: torch.Tensor = field(repr=False)  # (F,)
    prompt_len: int = 0
    seconds: float = 0.0  # featurise + decide


def nlms_step(weights: torch.Tensor, x: torch.Tensor, reward: float, lr: float) -> float:
    """One normalised LMS step in place; returns the prediction error before it."""
    error = reward - float(weights @ x)
    weights.add_(x, alpha=lr * error / max(float(x @ x), 1e-12))
    return error


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b) / max(float(a.norm() * b.norm()), 1e-12)


class Router:
    """Thread-safe: the worker decides, the feedback thread learns."""

    def __init__(self, names: list[str], config: RouteConfig | None = None, featurize=None):
        from osd.route.features import feature_size, prompt_features

        self.config = config or RouteConfig()
        c = self.config
        self.size = feature_size(c.route_buckets)
        self.featurize = featurize or (lambda ids: prompt_features(ids, "", c.route_buckets, c.route_window))
        self.weights: dict[str, torch.Tensor] = {}
        self.centroids: dict[str, torch.Tensor | None] = {}
        self.rng = random.Random(c.route_seed)
        self._lock = threading.Lock()
        self.decisions = {r: {} for r in REASONS}  # reason -> draft -> count
        self.routed = self.explored = 0  # non-pinned decisions, and those explored (the share bound)
        self.route_seconds = 0.0
        self.updates = 0
        for name in names:
            self.add(name)

    # --- drafts ---------------------------------------------------------------------------------
    def add(self, name: str, like: str | None = None) -> None:
        """A new draft; `like`: start from that draft's predictor (a copy of its adapter)."""
        with self._lock:
            if name in self.weights:
                raise InvalidArgument(f"the router knows a draft named {name!r} already")
            self.weights[name] = self.weights[like].clone() if like is not None else torch.zeros(self.size)
            self.centroids[name] = None

    def remove(self, name: str) -> None:
        with self._lock:
            self._known(name)
            del self.weights[name], self.centroids[name]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self.weights)

    def _known(self, name: str) -> None:
        if name not in self.weights:
            raise DraftNotFound(f"no draft named {name!r}; known: {sorted(self.weights)}")

    # --- deciding -------------------------------------------------------------------------------
    def route(self, prompt_ids: list[int], pinned: str | None = None) -> Decision:
        import time

        t0 = time.perf_counter()
        x = self.featurize(prompt_ids)
        decision = self.choose(x, pinned)
        decision.prompt_len, decision.seconds = len(prompt_ids), time.perf_counter() - t0
        return decision

    def predict(self, x: torch.Tensor) -> dict[str, float]:
        with self._lock:
            return {name: float(w @ x) for name, w in sorted(self.weights.items())}

    def choose(self, x: torch.Tensor, pinned: str | None = None) -> Decision:
        scores = self.predict(x)
        if not scores:
            raise DraftNotFound("the router has no drafts")
        if pinned is not None:
            with self._lock:
                self._known(pinned)
            return Decision(pinned, "pinned", scores, x)
        c = self.config
        with self._lock:
            may_explore = len(scores) > 1 and self.explored + 1 <= c.explore * (self.routed + 1)
            if may_explore and self.rng.random() < c.explore:
                best = max(scores, key=scores.get)
                return Decision(self.rng.choice([n for n in scores if n != best]), "explore", scores, x)
            top = max(scores.values())
            tied = [n for n, s in scores.items() if s >= top - c.route_margin]
            if len(tied) == 1:
                return Decision(tied[0], "routed", scores, x)
            return Decision(self._cold(x, tied), "cold", scores, x)

    def _cold(self, x: torch.Tensor, tied: list[str]) -> str:
        """Nearest served traffic among the tied drafts, or a fresh draft for a request unlike all of them."""
        served = {n: cosine(x[:-1], self.centroids[n][:-1]) for n in tied if self.centroids[n] is not None}
        fresh = [n for n in tied if self.centroids[n] is None]
        if not served:
            return fresh[0]
        nearest = max(served, key=served.get)
        return fresh[0] if fresh and served[nearest] < self.config.route_split_similarity else nearest

    def commit(self, decision: Decision) -> None:
        """Count a decision whose request was served; its draft's traffic centroid moves toward it."""
        with self._lock:
            if decision.draft not in self.weights:
                return  # retired meanwhile
            by_draft = self.decisions[decision.reason]
            by_draft[decision.draft] = by_draft.get(decision.draft, 0) + 1
            self.route_seconds += decision.seconds
            if decision.reason == "pinned":
                return
            self.routed += 1
            self.explored += decision.reason == "explore"
            if decision.reason != "explore":  # explored traffic is not the draft's own
                c = self.centroids[decision.draft]
                ema = self.config.route_centroid_ema
                self.centroids[decision.draft] = decision.features.clone() if c is None else (1 - ema) * c + ema * decision.features

    # --- learning -------------------------------------------------------------------------------
    def learn(self, x: torch.Tensor, rewards: dict[str, float]) -> None:
        """Move each named draft's predictor toward its observed acceptance on a request with features x."""
        with self._lock:
            for name, reward in rewards.items():
                if name in self.weights:
                    nlms_step(self.weights[name], x, reward, self.config.route_lr)
            self.updates += 1

    def stats(self) -> dict:
        with self._lock:
            return {"routed": self.routed, "explored": self.explored, "updates": self.updates,
                    "route_seconds": self.route_seconds,
                    "decisions": {r: dict(d) for r, d in self.decisions.items()}}
