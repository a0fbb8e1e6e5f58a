"""Server settings: one dataclass, validated on construction; `osd serve` maps its flags onto it."""
from __future__ import annotations

from dataclasses import dataclass, field

from osd.errors import InvalidArgument


@dataclass
class ServeSettings:
    host: str = "127.0.0.1"  # loopback by default: exposing the server is an explicit choice
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* requires "Authorization: Bearer <api_key>"
    max_body_bytes: int = 1_000_000  # larger request bodies get 413
    default_max_tokens: int = field(default=256, metadata={"help": (
        "a request without max_tokens gets what the context has left after its prompt, at most this many")})
    max_queue: int = field(default=64, metadata={"help": (
        "requests waiting for a place in the scheduler beyond the running ones; past it a request gets 503 "
        "queue_full with Retry-After at once instead of an unbounded wait (0 = no bound; one engine: a --replicas "
        "front does not bound its queue yet)")})
    default_temperature: float = 1.0  # when a request gives no temperature (OpenAI's default)
    model_name: str | None = None  # the name clients send as `model`; None = the name given to create_app
    metrics_require_key: bool = False  # GET /metrics needs the API key too (it needs api_key set)

    def __post_init__(self):
        if not (0 <= self.port <= 65535):
            raise InvalidArgument(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes <= 0:
            raise InvalidArgument(f"max_body_bytes must be > 0, got {self.max_body_bytes}")
        if self.default_max_tokens <= 0:
            raise InvalidArgument(f"default_max_tokens must be > 0, got {self.default_max_tokens}")
        if self.max_queue is None or self.max_queue < 0:
            raise InvalidArgument(f"max_queue must be >= 0 (0 = no bound), got {self.max_queue}")
        if self.default_temperature < 0:
            raise InvalidArgument(f"default_temperature must be >= 0, got {self.default_temperature}")
        if self.api_key == "":
            self.api_key = None
        if self.metrics_require_key and self.api_key is None:
            raise InvalidArgument("metrics_require_key needs an api_key (--api-key or $OSD_API_KEY)")
