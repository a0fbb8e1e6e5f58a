"""The router: which draft serves a request, decided before decoding from the prompt's features.

Per draft d a linear predictor of its advantage on a request (its acceptance minus the mean over drafts),
score_d(x) = w_d . x, fitted by exponentially weighted ridge regression on every scored request:
    A = lam A + (1 - lam) ridge I + x x^T,   B = lam B + x (r - mean r)^T,   W = A^-1 B   (F x D)
Full-information feedback (every draft's acceptance on a finished request, route/feedback.py) updates every
draft at once, so the router learns about drafts that did not serve. lam < 1 forgets old requests, so the
router follows drafts whose acceptance changes as they learn; the (1 - lam) ridge I term keeps A >= ridge I
(no wind-up of directions the traffic never excites). Advantages, not acceptances: how hard a request is
cancels, only which draft is better is learnt. Cost: routing is one (F,) x (F, D) product; learning one
F x F solve per scored request (F = 527 by default: a few milliseconds, off the decoding path).

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


def ridge_step(gram: torch.Tensor, moments: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, forget: float,
               ridge: float) -> torch.Tensor:
    """One exponentially weighted ridge update in place; returns the new weights A^-1 B.

    gram (F, F) = A, moments (F, D) = B, x (F,), targets (D,)."""
    gram.mul_(forget).diagonal().add_((1 - forget) * ridge)
    gram.addr_(x, x)
    moments.mul_(forget).addr_(x, targets)
    return torch.linalg.solve(gram, moments)  # (F, D)


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
        self.order: list[str] = []  # draft of each column of weights / moments
        self.gram = torch.eye(self.size) * c.route_ridge  # (F, F) A
        self.moments = torch.zeros(self.size, 0)  # (F, D) B
        self.weights = torch.zeros(self.size, 0)  # (F, D) W = A^-1 B
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
            if name in self.order:
                raise InvalidArgument(f"the router knows a draft named {name!r} already")
            if like is not None:
                self._known(like)
            column = self.order.index(like) if like is not None else None
            new = lambda m: m[:, column : column + 1].clone() if column is not None else torch.zeros(self.size, 1)
            self.moments = torch.cat([self.moments, new(self.moments)], 1)
            self.weights = torch.cat([self.weights, new(self.weights)], 1)
            self.order.append(name)
            self.centroids[name] = None

    def remove(self, name: str) -> None:
        with self._lock:
            self._known(name)
            keep = [i for i, n in enumerate(self.order) if n != name]
            self.moments, self.weights = self.moments[:, keep], self.weights[:, keep]
            self.order.remove(name)
            del self.centroids[name]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self.order)

    def _known(self, name: str) -> None:
        if name not in self.order:
            raise DraftNotFound(f"no draft named {name!r}; known: {sorted(self.order)}")

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
            scores = (x @ self.weights).tolist()  # (D,)
            return dict(sorted(zip(self.order, scores)))

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
            if decision.draft not in self.order:
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
        """Every draft's acceptance on a request with features x (full information). A draft missing from
        `rewards` (created after the request) is given its own prediction: no evidence either way."""
        with self._lock:
            known = [rewards[n] for n in self.order if n in rewards]
            if not known:
                return
            mean = sum(known) / len(known)
            predicted = (x @ self.weights).tolist()
            targets = torch.tensor([rewards[n] - mean if n in rewards else p for n, p in zip(self.order, predicted)])
            c = self.config
            self.weights = ridge_step(self.gram, self.moments, x, targets, c.route_forget, c.route_ridge)
            self.updates += 1

    def stats(self) -> dict:
        with self._lock:
            return {"routed": self.routed, "explored": self.explored, "updates": self.updates,
                    "route_seconds": self.route_seconds,
                    "decisions": {r: dict(d) for r, d in self.decisions.items()}}
