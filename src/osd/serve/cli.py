"""CLI entry for serving: `osd serve`. Parse -> config -> call the library."""
from __future__ import annotations

import argparse
import os

from osd.flags import add_config_flags, config_from
from osd.serve.settings import ServeSettings


def register(sub) -> None:
    """Add `osd serve` to the `osd` parser (sub)."""
    from osd.config import ModelConfig, SpeculationConfig
    from osd.learn.online import LearnConfig
    from osd.route.config import RouteConfig

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with speculative decoding")
    add_config_flags(p, ServeSettings, skip=("api_key", "model_name"))
    p.add_argument("--api-key", default=os.environ.get("OSD_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1/* (and on /metrics with --metrics-require-key; "
                   "default $OSD_API_KEY; none = open)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the target's name)")
    p.add_argument("--replicas", type=int, default=0,
                   help="serve from N engine replicas on Ray behind this one HTTP front, one learner fed by all "
                        "(needs `pip install 'osd[ray]'`; 0 = one engine in this process, Ray never imported)")
    p.add_argument("--ray-address", default=None,
                   help="with --replicas: join this Ray cluster (`auto`, or <head>:6379) instead of starting a local "
                        "one; its actors then outlive this front")
    p.add_argument("--learn", action=argparse.BooleanOptionalAction, default=True,
                   help="distill the draft online from served traffic (on by default; LearnConfig flags)")
    for cls in (ModelConfig, SpeculationConfig, LearnConfig, RouteConfig):
        add_config_flags(p, cls)
    p.set_defaults(max_batch=8)  # serving: continuous batching of up to 8 sequences per step
    # serving under load: the learner's share of the busy time (learn/budget.py: earned from the serving steps' seconds),
    # what learning costs there on top of observing. Under the old idle-window rule 0.05 let a 75 s load at 8 clients
    # take 0 optimizer steps (benchmarks/bench-scale-noray-48-steps.json); 0.1 runs an update (~90 chunks) in ~15 s
    # of learner time, so a busy server publishes within tens of requests. Idle windows are not limited by it.
    p.set_defaults(busy_share=0.1)
    p.set_defaults(schedule="background", checkpoint_dir="runs/draft-checkpoint", score_schedule="background")  # serving: learn in idle windows, resume on restart
    p.set_defaults(func=cmd_serve)


def default_model_name(target: str) -> str:
    return target.removeprefix("bundled:")


def cmd_serve(args) -> None:
    from osd.build import attach_learner, build_system
    from osd.config import ModelConfig, SpeculationConfig
    from osd.learn.online import LearnConfig
    from osd.memory import return_freed_memory_to_the_system
    from osd.route.config import RouteConfig

    return_freed_memory_to_the_system()  # a long-running process: freed tensors must not stay resident
    settings = config_from(args, ServeSettings)
    models = config_from(args, ModelConfig)
    if args.replicas:
        cmd_serve_cluster(args, settings, models)
        return
    spec = config_from(args, SpeculationConfig)
    system = build_system(models, spec, with_draft=spec.k > 0 or args.learn, route=config_from(args, RouteConfig))
    system.engine.calibrate()
    learn = args.learn and system.draft_master is not None  # no draft model (n-gram lookup only): nothing to learn
    learner = attach_learner(system, config_from(args, LearnConfig)) if learn else None
    name = settings.model_name or default_model_name(models.target)
    serve(system.engine, system.tokenizer, name, settings, learner, system.routing)


def cmd_serve_cluster(args, settings, models) -> None:
    from osd.config import SpeculationConfig
    from osd.errors import BackendUnavailable, InvalidArgument
    from osd.learn.online import LearnConfig
    from osd.route.config import RouteConfig

    if config_from(args, RouteConfig).names():
        raise InvalidArgument("--replicas with several drafts (--drafts) is not supported yet: one draft per cluster")
    try:
        from osd.cluster.launch import serve_cluster
    except ImportError as e:
        raise BackendUnavailable(f"--replicas needs Ray: pip install 'osd[ray]' ({e})") from e
    from osd.build import resolve_draft

    models, spec = resolve_draft(models, config_from(args, SpeculationConfig))  # once, before the replicas start
    learn = config_from(args, LearnConfig) if args.learn and models.draft else None  # no draft model: nothing to learn
    name = settings.model_name or default_model_name(models.target)
    serve_cluster(models, spec, learn, settings, name, args.replicas, args.ray_address)


def serve(engine, tokenizer, model_name: str, settings: ServeSettings, learner=None, routing=None) -> None:
    """Run the server until SIGINT/SIGTERM; shutdown cancels the running requests, then stops the learner.
    The model work runs on this (the main) thread, the HTTP server on another (serve/worker.py says why)."""
    import signal
    import threading

    import uvicorn

    from osd.serve.app import create_app

    app = create_app(engine, tokenizer, model_name, learner=learner, settings=settings, routing=routing,
                     worker_thread=False)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                                           timeout_graceful_shutdown=30))
    http = threading.Thread(target=server.run, name="osd-http", daemon=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    http.start()
    try:
        app.state.worker.run_here(keep_going=http.is_alive)  # until the lifespan's shutdown stops the worker
    finally:
        server.should_exit = True
        http.join(60)
        app.state.lifecycle.stop()  # idempotent: normally done already by the lifespan shutdown
