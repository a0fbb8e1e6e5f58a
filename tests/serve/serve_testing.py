"""A real uvicorn server on 127.0.0.1 (a free port) serving tiny seeded models, for the serve tests.

Named serve_testing (not conftest) so `from conftest import ...` keeps meaning tests/conftest.py.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from conftest import ToyTokenizer, tiny_qwen2
from helpers import make_engine
from openai import OpenAI

from osd.serve.app import create_app
from osd.serve.settings import ServeSettings
from osd.serve.threaded import serve_in_thread

MODEL = "tiny-target"


class FakeLearner:
    """Duck-typed stand-in for the online learner: start/stop/stats."""

    def __init__(self):
        self.started = self.stopped = 0

    def start(self):
        self.started += 1

    def stop(self):
        self.stopped += 1

    def stats(self) -> dict:
        return {"buffer_positions": 7, "updates_published": 2, "updates_rejected": 0, "version": 2,
                "training": 1, "note": "not numeric: skipped"}


@dataclass
class Served:
    url: str
    target: object
    tokenizer: ToyTokenizer
    engine: object
    registry: object
    learner: FakeLearner | None
    api_key: str | None

    def client(self, api_key: str | None = None) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=api_key or self.api_key or "unused", max_retries=0, timeout=60)

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


def live_server(app, ready_timeout: float = 20.0):
    """Run `app` under uvicorn on a thread; yield its base URL; shut down gracefully (lifespan included)."""
    return serve_in_thread(app, ready_timeout)


@contextmanager
def tiny_server(api_key: str | None = None, learner: FakeLearner | None = None, k: int = 4, max_batch: int = 1,
                **settings):
    target, draft, tokenizer = tiny_qwen2(seed=0), tiny_qwen2(seed=1, layers=1), ToyTokenizer()
    engine, registry = make_engine(target, draft, tokenizer, k=k, max_batch=max_batch)
    settings = ServeSettings(api_key=api_key, **settings)
    app = create_app(engine, tokenizer, MODEL, learner=learner, settings=settings)
    with live_server(app) as url:
        yield Served(url, target, tokenizer, engine, registry, learner, api_key)


# Learning that publishes on tiny models: every 2 requests, every position, the guard off (it is tested elsewhere).
TINY_LEARN = dict(mode="all", every_requests=2, trainable="all", train_layers=0, guard=False, lr=1e-2,
                  steps_per_update=4, batch_size=4, schedule="background")


@contextmanager
def learning_server(root, checkpoint_dir, api_key: str | None = None, max_batch: int = 4, **settings):
    """What `osd serve` runs, in process, on the tiny pair saved under root (conftest.save_tiny_pair): the real online
    learner, the scheduler with `max_batch` sequences per step. Yields (Served, system)."""
    from osd.build import attach_learner, build_system
    from osd.config import ModelConfig, SpeculationConfig
    from osd.learn.online import LearnConfig

    models = ModelConfig(target=str(root / "target"), draft=str(root / "draft"), draft_quantize="none",
                         prepack_target=False)  # serving copies stay fp32 (the kernels are tested elsewhere)
    system = build_system(models, SpeculationConfig(k=3, adaptive=False, max_batch=max_batch))
    learner = attach_learner(system, LearnConfig(**TINY_LEARN, checkpoint_dir=str(checkpoint_dir)))
    app = create_app(system.engine, system.tokenizer, MODEL, learner=learner,
                     settings=ServeSettings(api_key=api_key, **settings))
    with live_server(app) as url:
        yield Served(url, system.target_model, system.tokenizer, system.engine, system.registry, learner, api_key), system
