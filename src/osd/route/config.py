"""RouteConfig: several drafts and the router that picks one per request (flags of `osd serve`, `osd replay`).

Field names carry a route_ / adapter_ / score_ prefix where a bare name would clash with another config's
CLI flag (LearnConfig has lr, seed, train_layers).
"""
from __future__ import annotations

from dataclasses import dataclass

from osd.errors import InvalidArgument

SCHEDULES = ("sync", "background")


@dataclass
class RouteConfig:
    drafts: str = ""  # comma-separated draft names: adapters on the base draft, routed per request ("" = one draft)
    explore: float = 0.05  # at most this share of routed requests go to another draft than the router's choice
    score_share: float = 0.25  # share of finished requests on which EVERY draft is scored teacher-forced (full information)
    score_time_share: float = 0.02  # ... and scoring stops while its seconds exceed this share of serving seconds
    score_max_tokens: int = 1024  # tokens (prompt tail + output) one scoring forward covers at most
    score_schedule: str = "sync"  # sync: score inside the request observer | background: in idle windows (serving)
    route_forget: float = 0.998  # the router's ridge regression forgets old requests by this factor each (~500 requests)
    route_ridge: float = 0.1  # ridge regularisation of the router's regression
    route_margin: float = 0.01  # predicted advantages within this of the best tie: the request's owner serves
    route_z: float = 1.64  # another draft than the owner serves only when its predicted lead over the owner exceeds
    #   margin + route_z prediction standard deviations (route/policy.py; 0 = the margin alone)
    route_warmup: int = 128  # requests (all owned by the first draft) on which k-means then finds one mode per draft
    route_split_similarity: float = 0.3  # a draft without a mode claims a request less similar (cosine) than this to
    #   every mode (route/policy.py)
    route_centroid_ema: float = 0.05  # weight of a new request in its draft's traffic centroid
    route_buckets: int = 512  # hashed n-gram buckets of the prompt features
    route_window: int = 512  # prompt tokens (the last ones) the features look at
    route_seed: int = 0
    adapter_rank: int = 8
    adapter_alpha: float = 16.0
    adapter_layers: int = 4  # adapters on the top N decoder layers; the drafts' learners train exactly these
    adapter_serving: str = "adapter"  # adapter: shared serving linears + low-rank update | merged: folded, per draft

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
