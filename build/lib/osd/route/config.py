"""RouteConfig: several drafts and the router that picks one per request (flags of `osd serve`, `osd replay`).

Field names carry a route_ / adapter_ / score_ prefix where a bare name would clash with another config's
CLI flag (LearnConfig has lr, seed, train_layers).
"""
from __future__ import annotations

from dataclasses import dataclass

from osd.errors import InvalidArgument
from osd.flags import option

SCHEDULES = ("sync", "background")


@dataclass
class RouteConfig:
    drafts: str = option("", "comma-separated draft names: adapters on the base draft, one chosen per request by a "
                         "router; none = one draft")
    explore: float = option(0.05, "at most this share of routed requests go to another draft than the router's "
                            "choice")
    score_share: float = option(0.25, "share of finished requests on which every draft is scored (teacher-forced) "
                                "to train the router")
    score_time_share: float = option(0.02, "... and scoring pauses while its seconds exceed this share of serving "
                                     "seconds")
    score_max_tokens: int = option(1024, "most tokens (prompt tail + output) one scoring forward covers")
    score_schedule: str = option("sync", "when drafts are scored: sync = inside the request's observer, background "
                                 "= in idle windows (serving)", choices=SCHEDULES)
    route_forget: float = option(0.998, "the router's regression forgets old requests by this factor each "
                                 "(~500 requests)")
    route_ridge: float = option(0.1, "ridge regularisation of the router's regression")
    route_margin: float = option(0.01, "predicted advantages within this of the best tie: the request's owner serves")
    route_z: float = option(1.64, "another draft than the owner serves only when its predicted lead exceeds the "
                            "margin + this many prediction standard deviations (route/policy.py; 0 = the margin "
                            "alone)")
    route_warmup: int = option(128, "requests (all served by the first draft) on which k-means then finds one "
                               "traffic mode per draft")
    route_split_similarity: float = option(0.3, "a draft without a mode claims a request less similar (cosine) than "
                                           "this to every mode (route/policy.py)")
    route_centroid_ema: float = option(0.05, "weight of a new request in its draft's traffic centroid")
    route_buckets: int = option(512, "hashed n-gram buckets of the prompt features")
    route_window: int = option(512, "prompt tokens (the last ones) the features look at")
    route_seed: int = option(0, "seed of the router and the adapters' initialisation")
    adapter_rank: int = option(8, "rank of each draft's low-rank adapter")
    adapter_alpha: float = option(16.0, "scale (alpha) of each draft's adapter")
    adapter_layers: int = option(4, "adapters on the top N decoder layers (the drafts' learners train exactly "
                                 "these)")
    adapter_serving: str = option("adapter", "how the drafts serve: adapter = shared linears + each one's low-rank "
                                  "update, merged = folded into weights of its own per draft",
                                  choices=("adapter", "merged"))

    @classmethod
    def serving(cls, **overrides) -> "RouteConfig":
        """`osd serve`'s defaults: the drafts are scored in idle windows, off the requests' path."""
        return cls(**{"score_schedule": "background", **overrides})

    def __post_init__(self):
        if not (0.0 <= self.explore < 1.0) or not (0.0 <= self.score_share <= 1.0) or self.score_time_share < 0:
            raise InvalidArgument("explore must be in [0, 1), score_share in [0, 1], score_time_share >= 0")
        if self.score_schedule not in SCHEDULES:
            raise InvalidArgument(f"score_schedule must be one of {SCHEDULES}, got {self.score_schedule!r}")
        if not 0 < self.route_forget <= 1 or self.route_ridge <= 0 or self.route_margin < 0 or self.route_z < 0:
            raise InvalidArgument("route_forget must be in (0, 1], route_ridge > 0, route_margin >= 0, route_z >= 0")
        if not 0 < self.route_centroid_ema <= 1 or self.route_buckets <= 0 or self.route_window < 0 or self.route_warmup < 0:
            raise InvalidArgument("route_centroid_ema in (0, 1], route_buckets > 0, route_window >= 0")
        if self.score_max_tokens < 2:
            raise InvalidArgument("score_max_tokens must be >= 2")
        names = self.names()
        if len(set(names)) != len(names) or any("+" in n for n in names):
            raise InvalidArgument(f"drafts must be distinct names without '+': {self.drafts!r}")

    def names(self) -> list[str]:
        return [n.strip() for n in self.drafts.split(",") if n.strip()]

    def adapter_config(self):
        from osd.drafts_multi import AdapterConfig

        return AdapterConfig(rank=self.adapter_rank, alpha=self.adapter_alpha, train_layers=self.adapter_layers,
                             serving=self.adapter_serving, seed=self.route_seed)
