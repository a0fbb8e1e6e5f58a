"""Server settings: one dataclass, validated on construction; `osd serve` maps its flags onto it."""
from __future__ import annotations

from dataclasses import dataclass

from osd.errors import InvalidArgument
from osd.flags import option

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class ServeSettings:
    # loopback by default: exposing the server is an explicit choice
    host: str = option("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(None, "require 'Authorization: Bearer <key>' on /v1/*; none = open")
    max_body_bytes: int = option(1_000_000, "larger request bodies get 413")
    default_max_tokens: int = option(256, "a request without max_tokens gets what the context has left after its "
                                     "prompt, at most this many")
    max_queue: int = option(64, "requests waiting for a place in the scheduler beyond the running ones; past it a "
                            "request gets 503 queue_full with Retry-After at once instead of an unbounded wait (0 = no "
                            "bound; one engine: a --replicas front does not bound its queue yet)")
    default_temperature: float = option(1.0, "temperature of a request that gives none (OpenAI's default)")
    model_name: str | None = option(None, "the model id clients send as `model` (and /v1/models lists); none = the "
                                    "target's name", aliases=("--served-model-name",))
    metrics_require_key: bool = option(False, "GET /metrics needs the API key too (needs --api-key)")
    chat_template: str | None = option(None, "a Jinja chat template (a file, or the template itself) used instead of "
                                       "the tokenizer's to turn /v1/chat/completions messages into a prompt; none = "
                                       "the tokenizer's own")
    log_level: str = option("info", "logging level of the server (and of uvicorn's access log)", choices=LOG_LEVELS)
    stats_interval: float = option(10.0, "log a line of what the server is doing (requests running and queued, "
                                   "tokens/s, acceptance, k, draft version, learner) every this many seconds while "
                                   "it works; 0 = never")

    keep_alive: int = option(30, (
        "seconds an idle HTTP keep-alive connection stays open; longer than clients' own idle expiry (httpx and the "
        "openai client: 5 s), so that a client never sends a request on a connection the server is closing at that "
        "instant (uvicorn's default, 5 s, raced with them: a streamed request failed with a read error 4 ms after it "
        "was sent, in osd bench live)"))
    calibration: str | None = option(None, "a JSON file of the engine's costs (a target pass by rows, each draft's "
                                     "token) that decide k: read when it exists, else measured at startup and written "
                                     "there; servers given one file choose k from the same costs (one engine: "
                                     "--replicas measure their own); none = measured, not kept")

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
        if self.log_level not in LOG_LEVELS:
            raise InvalidArgument(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.keep_alive is None or self.keep_alive < 1:
            raise InvalidArgument(f"keep_alive must be >= 1 second, got {self.keep_alive}")
        if self.stats_interval is None or self.stats_interval < 0:
            raise InvalidArgument(f"stats_interval must be >= 0 seconds (0 = off), got {self.stats_interval}")
        if self.chat_template == "":
            self.chat_template = None


def http_config(app, settings: ServeSettings):
    """The uvicorn.Config `osd serve` runs `app` under (one engine, or a --replicas front)."""
    import uvicorn

    from osd.logs import uvicorn_options

    return uvicorn.Config(app, host=settings.host, port=settings.port, timeout_graceful_shutdown=30,
                          timeout_keep_alive=settings.keep_alive, **uvicorn_options(settings.log_level))
