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

Two drafts per request: the OWNER learns from it, the SERVED one decodes it.
- owner: the mode (cluster) the request belongs to (route/cluster.py). The first `route_warmup` requests are
  all owned by the first draft and kept; then spherical k-means (k = drafts) on them gives each draft a mode,
  the largest to the first draft (it learnt them all); from then on the owner is the draft whose mode centroid
  is nearest (cosine of IDF-weighted token counts, so that a chat template every prompt shares weighs
  nothing), and the centroid follows its traffic (EMA). A draft without a mode (created later, or more drafts
  than warm-up requests) claims a request unlike every mode (cosine < route_split_similarity); with
  route_warmup = 0 that greedy leader rule is the whole clustering. Each draft so learns one mode of the
  traffic, as the paper's per-mode drafts do. Learning by the served draft instead is rich-get-richer: whichever draft trains first is best
  everywhere for a while (early learning is mostly not mode-specific), serves everything, and the others never
  learn (observed on the tiny two-mode replay of tests/route/test_replay_routed.py before owners existed).
- served, in order: 1. pinned: the request names a draft (unknown -> DraftNotFound; it owns the request too);
  2. explore: with probability `explore`, but never past `explore` x (routed requests so far), a random other
  draft than the choice below (a live check of the router's belief, visible in the served draft's /metrics
  acceptance; most useful when scoring is sparse); 3. routed: the best predicted draft, when it leads the
  others by more than `margin` and, if it is not the owner, leads the owner by more than margin + z standard
  deviations of that predicted difference; 4. cold: otherwise the owner (drafts created equal tie, and a lead
  the router cannot tell from its own noise does not take a request from the draft that learns its mode).
  Why the bound: on 450 gsm8k / spider / code requests (BENCHMARKS.md, rev b6a0363) the clustering owned 0.96
  of requests right, but serving the best *predicted* draft at margin 0.01 served the label's draft on 0.47
  of them and cost 0.03 held-out against the oracle split: drafts that differ little were told apart by noise.
  With the bound, on 1,000 requests in four languages (rev 8a82e65), the routed drafts ended 0.004 below the
  oracle split (z 1.0), serving the label's draft on 0.96 of held-out requests.
  The standard deviation: sd(w_d.x - w_o.x) ~ sqrt(2 s2 x^T A^-1 x), s2 the exponentially weighted mean squared
  residual of the advantage predictions (a prior of PRIOR_VARIANCE for the first PRIOR_WEIGHT requests).
`route` decides without side effects; `commit` (after the request was served) counts it, updates the document
frequencies and moves the owner's centroid, so warm-up requests (engine.calibrate) leave no trace.
Limitations: scores are linear in the features (a draft's niche must be linearly separable in the hashed
token counts); modes are fixed by the warm-up requests (a mode absent from them joins the nearest one, unless
a draft without a mode is there to claim it); pinned requests stay out of the warm-up.
"""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import torch

from osd.errors import DraftNotFound, InvalidArgument
from osd.route.cluster import idf_weights, normalised, spherical_kmeans
from osd.route.config import RouteConfig

REASONS = ("pinned", "explore", "routed", "cold")
PRIOR_VARIANCE, PRIOR_WEIGHT = 0.01, 10.0  # residual variance of predicted advantages before evidence (sd 0.1)


@dataclass
class Decision:
    draft: str  # serves the request
    reason: str  # one of REASONS
    scores: dict[str, float]  # predicted advantage per draft
    features: torch.Tensor = field(repr=False)  # (F,)
    owner: str = ""  # learns from the request: the draft whose traffic (cluster) it belongs to
    prompt_len: int = 0
    seconds: float = 0.0  # featurise + decide


def ridge_step(gram: torch.Tensor, moments: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, forget: float,
               ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One exponentially weighted ridge update in place; returns the new weights A^-1 B and the Cholesky factor L of
    A (A = L L^T, A >= ridge I is positive definite), which also gives the predictions' uncertainty (quadratic_form).

    gram (F, F) = A, moments (F, D) = B, x (F,), targets (D,)."""
    gram.mul_(forget).diagonal().add_((1 - forget) * ridge)
    gram.addr_(x, x)
    moments.mul_(forget).addr_(x, targets)
    factor = torch.linalg.cholesky(gram)
    return torch.cholesky_solve(moments, factor), factor  # (F, D), (F, F)


def quadratic_form(factor: torch.Tensor, x: torch.Tensor) -> float:
    """x^T A^-1 x from A's Cholesky factor L: |L^-1 x|^2, one triangular solve."""
    y = torch.linalg.solve_triangular(factor, x[:, None], upper=False)
    return float(y.square().sum())


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
        self.factor = torch.linalg.cholesky(self.gram)  # (F, F) L, A = L L^T: the predictions' uncertainty
        self.residual_sq, self.residual_weight = 0.0, 0.0  # exponentially weighted sum of squared residuals, weight
        self.centroids: dict[str, torch.Tensor | None] = {}  # owner -> unit EMA of its traffic's IDF-weighted features
        self.documents, self.document_frequency = 0, torch.zeros(c.route_buckets)  # requests; requests per bucket
        self.warmup: list[torch.Tensor] | None = [] if c.route_warmup else None  # None: modes are set
        self.rng = random.Random(c.route_seed)
        self._lock = threading.Lock()
        self.decisions = {r: {} for r in REASONS}  # reason -> served draft -> count
        self.owned: dict[str, int] = {}  # owner -> requests it learnt from
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

    def choose(self, x: torch.Tensor, pinned: str | None = None, explore: bool = True) -> Decision:
        """explore=False: the router's own choice (measuring it on held-out requests)."""
        scores = self.predict(x)
        if not scores:
            raise DraftNotFound("the router has no drafts")
        if pinned is not None:
            with self._lock:
                self._known(pinned)
            return Decision(pinned, "pinned", scores, x, owner=pinned)
        c = self.config
        with self._lock:
            owner = self._cluster(x)
            may_explore = explore and len(scores) > 1 and self.explored + 1 <= c.explore * (self.routed + 1)
            top = max(scores.values())
            tied = [n for n, s in scores.items() if s >= top - c.route_margin]
            choice, reason = (tied[0], "routed") if len(tied) == 1 else (owner if owner in tied else tied[0], "cold")
            if choice != owner and owner in scores and c.route_z > 0 and \
                    scores[choice] - scores[owner] <= c.route_margin + c.route_z * self._difference_sd(x):
                choice, reason = owner, "cold"
            if may_explore and self.rng.random() < c.explore:
                return Decision(self.rng.choice([n for n in scores if n != choice]), "explore", scores, x, owner=owner)
            return Decision(choice, reason, scores, x, owner=owner)

    def _difference_sd(self, x: torch.Tensor) -> float:
        """Standard deviation of the difference of two drafts' predicted advantages at x (module docstring)."""
        variance = (PRIOR_VARIANCE * PRIOR_WEIGHT + self.residual_sq) / (PRIOR_WEIGHT + self.residual_weight)
        return (2 * variance * quadratic_form(self.factor, x)) ** 0.5

    def _cluster(self, x: torch.Tensor) -> str:
        """The draft whose mode the request belongs to (module docstring)."""
        if self.warmup is not None:
            return self.order[0]
        weighted = self._idf_weighted(x)
        owned = {n: cosine(weighted, c) for n, c in self.centroids.items() if c is not None}
        fresh = [n for n in self.order if self.centroids[n] is None]
        if not owned:
            return fresh[0]
        nearest = max(owned, key=owned.get)
        return fresh[0] if fresh and owned[nearest] < self.config.route_split_similarity else nearest

    def _idf_weighted(self, x: torch.Tensor) -> torch.Tensor:
        """(..., F) -> (..., F - 1): the bias left out, token buckets weighted by IDF over the requests so far."""
        b = self.config.route_buckets
        return torch.cat([x[..., :b] * idf_weights(self.document_frequency, self.documents), x[..., b:-1]], -1)

    def _set_modes(self) -> None:
        """k-means on the warm-up requests: one mode per draft (the largest to the first draft)."""
        points = normalised(self._idf_weighted(torch.stack(self.warmup)))  # (N, F - 1)
        centroids, assign = spherical_kmeans(points, len(self.order), self.config.route_seed)
        sizes = torch.bincount(assign, minlength=len(centroids))
        for name, j in zip(self.order, sizes.argsort(descending=True).tolist()):
            self.centroids[name] = centroids[j]
        self.warmup = None

    def commit(self, decision: Decision) -> None:
        """Count a decision whose request was served; the owner's traffic centroid moves toward it."""
        with self._lock:
            if decision.draft not in self.order:
                return  # retired meanwhile
            by_draft = self.decisions[decision.reason]
            by_draft[decision.draft] = by_draft.get(decision.draft, 0) + 1
            self.route_seconds += decision.seconds
            self.owned[decision.owner] = self.owned.get(decision.owner, 0) + 1
            self.routed += decision.reason != "pinned"
            self.explored += decision.reason == "explore"
            x, b = decision.features, self.config.route_buckets
            self.documents += 1
            self.document_frequency += (x[:b] > 0).float()
            if self.warmup is not None:
                if decision.reason != "pinned":
                    self.warmup.append(x.clone())
                if len(self.warmup) >= self.config.route_warmup:
                    self._set_modes()
            elif decision.owner in self.centroids:
                c, w = self.centroids[decision.owner], normalised(self._idf_weighted(x))
                ema = self.config.route_centroid_ema
                self.centroids[decision.owner] = w if c is None else normalised((1 - ema) * c + ema * w)

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
            residuals = [t - p for n, t, p in zip(self.order, targets.tolist(), predicted) if n in rewards]
            self.residual_sq = c.route_forget * self.residual_sq + sum(r * r for r in residuals) / len(residuals)
            self.residual_weight = c.route_forget * self.residual_weight + 1.0
            self.weights, self.factor = ridge_step(self.gram, self.moments, x, targets, c.route_forget, c.route_ridge)
            self.updates += 1

    def stats(self) -> dict:
        with self._lock:
            return {"routed": self.routed, "explored": self.explored, "updates": self.updates,
                    "route_seconds": self.route_seconds, "modes_set": self.warmup is None, "owned": dict(self.owned),
                    "decisions": {r: dict(d) for r, d in self.decisions.items()}}
