"""CLI entry for serving: `osd serve`. Parse -> config -> call the library."""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import replace

from osd.flags import HELP_DEFAULT, add_config_flags, config_from
from osd.logs import configure_logging
from osd.serve.settings import ServeSettings, http_config


def register(sub) -> None:
    """Add `osd serve` to the `osd` parser (sub). Its defaults are the configs' serving() instances, declared beside
    the dataclasses, so that what --help shows is what runs (flags.py)."""
    from osd.config import ModelConfig, SpeculationConfig
    from osd.learn.head import HeadLearnConfig
    from osd.learn.online import LearnConfig
    from osd.route.config import RouteConfig

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with speculative decoding",
                       description="OpenAI-compatible HTTP server with speculative decoding and a draft distilled "
                       "online from the traffic it serves. Learner flags are --learn-*.")
    add_config_flags(p, ServeSettings, skip=("api_key",), title="server")
    # the key's default comes from the environment, and help must not print it
    p.add_argument("--api-key", default=os.environ.get("OSD_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1/* (and on /metrics with --metrics-require-key) "
                   "(default: $OSD_API_KEY; unset = open)")
    p.add_argument("--replicas", type=int, default=0,
                   help="serve from N engine replicas on Ray behind this one HTTP front, one learner fed by all "
                        "(needs `pip install 'osd[ray]'`; 0 = one engine in this process, Ray never imported) "
                        "(default: %(default)s)")
    p.add_argument("--ray-address", default=None,
                   help="with --replicas: join this Ray cluster (`auto`, or <head>:6379) instead of starting a local "
                        "one; its actors then outlive this front (default: %(default)s)")
    learn = p.add_argument("--learn", action=argparse.BooleanOptionalAction, default=True)
    learn.help = ("learn from the traffic served: distill the draft online (the --learn-* flags) and, with --lookup, "
                  "index finished requests for the n-gram lookup; --no-learn: what is served never changes how the "
                  "server drafts" + HELP_DEFAULT)  # set after:
    #   BooleanOptionalAction (Python 3.11) appends a default of its own
    add_config_flags(p, ModelConfig, title="models")
    add_config_flags(p, SpeculationConfig.serving(), skip=("lookup_traffic",), title="speculative decoding")  # --learn
    add_config_flags(p, LearnConfig.serving(), prefix="learn-", title="online learning, with --learn")  # the bare
    #   names (--top-k, ...) stay as hidden aliases
    add_config_flags(p, RouteConfig.serving(), title="several drafts routed per request, with --drafts")
    learn_head = p.add_argument("--learn-head", action=argparse.BooleanOptionalAction, default=False)
    learn_head.help = ("train the --head feature head online from served traffic, in place of the draft (the "
                       "--head-* flags; learn/head.py)" + HELP_DEFAULT)
    add_config_flags(p, HeadLearnConfig, title="the feature head's online learning, with --learn-head")
    p.set_defaults(func=cmd_serve)


def default_model_name(target: str) -> str:
    return target.removeprefix("bundled:")


def serving_spec(args):
    """The speculation flags, the lookup's traffic index following --learn (it learns from what is served)."""
    from osd.config import SpeculationConfig

    return replace(config_from(args, SpeculationConfig), lookup_traffic=args.learn)


def cmd_serve(args) -> None:
    from osd.build import attach_learner, build_system
    from osd.config import ModelConfig
    from osd.engine import calibrate_or_load
    from osd.learn.online import LearnConfig
    from osd.memory import return_freed_memory_to_the_system
    from osd.route.config import RouteConfig
    from osd.serve.chat_template import load_chat_template

    return_freed_memory_to_the_system()  # a long-running process: freed tensors must not stay resident
    settings = config_from(args, ServeSettings)
    configure_logging(settings.log_level)
    if settings.chat_template:
        load_chat_template(settings.chat_template)  # a bad one fails now, not after minutes of loading models
    models = config_from(args, ModelConfig)
    if args.replicas:
        cmd_serve_cluster(args, settings, models)
        return
    spec = serving_spec(args)
    system = build_system(models, spec, with_draft=spec.k > 0 or args.learn, route=config_from(args, RouteConfig))
    calibration, source = calibrate_or_load(system.engine, settings.calibration)
    logging.getLogger("osd.serve").info("%s (%s)", system.engine.describe_calibration(calibration), source)
    if args.learn_head:  # the head learns, the draft does not
        from osd.build import attach_head_learner
        from osd.learn.head import HeadLearnConfig

        learner = attach_head_learner(system, config_from(args, HeadLearnConfig))
    else:
        learn = args.learn and system.draft_master is not None  # no draft model (n-gram lookup only): nothing to learn
        learner = attach_learner(system, config_from(args, LearnConfig)) if learn else None
    name = settings.model_name or default_model_name(models.target)
    serve(system.engine, system.tokenizer, name, settings, learner, system.routing)


def cmd_serve_cluster(args, settings, models) -> None:
    from osd.errors import BackendUnavailable, InvalidArgument
    from osd.learn.online import LearnConfig
    from osd.route.config import RouteConfig

    if config_from(args, RouteConfig).names():
        raise InvalidArgument("--replicas with several drafts (--drafts) is not supported yet: one draft per cluster")
    if models.head or args.learn_head:
        raise InvalidArgument("--replicas with a feature head (--head) is not supported yet")
    try:
        from osd.cluster.launch import serve_cluster
    except ImportError as e:
        raise BackendUnavailable(f"--replicas needs Ray: pip install 'osd[ray]' ({e})") from e
    from osd.build import resolve_draft

    models, spec = resolve_draft(models, serving_spec(args))  # once, before the replicas start
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
    server = uvicorn.Server(http_config(app, settings))
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
