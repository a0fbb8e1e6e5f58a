"""CLI entries for serving: `osd serve` and `osd bench serve`. Parse -> config -> call the library."""
from __future__ import annotations

import argparse
import os

from osd.flags import add_config_flags, config_from
from osd.serve.settings import ServeSettings


def register(sub, bench) -> None:
    """Add the serving subcommands to the `osd` parser (sub) and the `osd bench` parser (bench)."""
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
    # serving under load: the learner's share of a saturated machine, what learning costs there on top of observing
    # (bench serve-vs at 8 clients, AMD EPYC, arms alternating: 0.1 cost 13.8% of the aggregate tokens/s, 0.05 10.3%,
    # and 2.8% once the learner's OpenMP team no longer outlived its chunks; benchmarks/bench-serve-vs-learning-abba*.json).
    # Idle windows are not limited by it.
    p.set_defaults(busy_share=0.05)
    p.set_defaults(schedule="background", checkpoint_dir="runs/draft-checkpoint", score_schedule="background")  # serving: learn in idle windows, resume on restart
    p.set_defaults(func=cmd_serve)

    p = bench.add_parser("serve", help="load a running server: throughput, TTFT, TPOT at several concurrencies")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of a running `osd serve`")
    p.add_argument("--prompts", default="chat", help="dataset name (shared/datasets) or JSONL path")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=8, help="prompts per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--raw", action="store_true", help="use /v1/completions instead of the chat endpoint")
    p.add_argument("--pair-learning", type=int, default=0, metavar="ROUNDS",
                   help="measure what online learning costs on one learning server: ROUNDS round pairs of the prompts, "
                        "learner running vs paused (POST /v1/osd/learner), alternating order; the first --concurrency "
                        "level only (default 0: off)")
    p.add_argument("--api-key", default=os.environ.get("OSD_API_KEY"))
    p.add_argument("--out", default="benchmarks/bench-serve.json")
    p.add_argument("--markdown", default="BENCHMARKS.md", help="append a summary here ('' = no)")
    p.set_defaults(func=cmd_bench_serve)

    p = bench.add_parser("serve-vs", help="osd serve against llama-server (-np N --cont-batching) under load, "
                         "side by side in one run: aggregate tokens/s, TTFT, e2e latency, peak RSS per level")
    p.add_argument("--target", default="bundled:qwen2.5-coder-1.5b", help="the GGUF both servers serve")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--per-level", type=int, default=16, help="requests per concurrency level (a new slice of prompts each)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--arms", nargs="+", default=["llama-server", "osd", "osd-learning", "osd-target-only"],
                   choices=["llama-server", "llama-server-native", "osd", "osd-learning", "osd-target-only"],
                   help="llama-server: built with the portable AVX2 flags of llama-cpp-python's wheel; "
                        "llama-server-native: built for this CPU (-DGGML_NATIVE=ON, AVX-512 where it has it), as "
                        "llama.cpp builds by default; both once per machine, cached")
    p.add_argument("--osd-args", default="--lookup", help="more `osd serve` flags for every osd arm (one string)")
    p.add_argument("--prefill-chars", type=int, default=4000,
                   help="also time each server's prefill of one long prompt of about this many characters (~1,000 "
                        "tokens of code test prompts; 0 = skip)")
    p.add_argument("--out", default="benchmarks/bench-serve-vs.json")
    p.add_argument("--markdown", default="BENCHMARKS.md", help="append a summary here ('' = no)")
    p.set_defaults(func=cmd_bench_serve_vs)


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
    learner = attach_learner(system, config_from(args, LearnConfig)) if args.learn else None
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
    learn = config_from(args, LearnConfig) if args.learn else None
    name = settings.model_name or default_model_name(models.target)
    serve_cluster(models, config_from(args, SpeculationConfig), learn, settings, name, args.replicas, args.ray_address)


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


def cmd_bench_serve_vs(args) -> None:
    import shlex

    from osd.bench.serve_compare import CompareConfig, interleaved_prompts, long_prompt, run_compare
    from osd.bench.serve_report import report_vs
    from osd.errors import InvalidArgument
    from osd.models.loading import gguf_file

    gguf = gguf_file(args.target)
    if gguf is None:
        raise InvalidArgument(f"serve-vs compares servers of one GGUF; {args.target!r} is not one")
    levels = tuple(args.concurrency)
    config = CompareConfig(gguf, interleaved_prompts(1 + args.per_level * len(levels)), levels, args.per_level,
                           args.max_tokens, args.threads, args.port, arms=tuple(args.arms),
                           osd_args=tuple(shlex.split(args.osd_args)) + ("--target", args.target))
    config.long_prompt = long_prompt(args.prefill_chars) if args.prefill_chars else None
    result = run_compare(config)
    result["config"] = {"target": args.target, "gguf": str(gguf), "levels": list(levels), "per_level": args.per_level,
                        "max_tokens": args.max_tokens, "threads": args.threads, "arms": list(args.arms),
                        "osd_args": args.osd_args, "temperature": 0, "prefill_chars": args.prefill_chars}
    report_vs(result, args.out, args.markdown)


def cmd_bench_serve(args) -> None:
    from osd.data import load_records
    from osd.errors import InvalidArgument
    from osd.bench.serve_load import run_load
    from osd.bench.serve_report import report_load

    prompts = [r["prompt"] for r in load_records(args.prompts, split=args.split or None, limit=args.limit)]
    if not prompts or min(args.concurrency) < 1:
        raise InvalidArgument("bench serve needs at least one prompt and concurrency levels >= 1")
    if args.pair_learning:
        from osd.bench.serve_load import run_paired_learning
        from osd.bench.serve_report import print_round, report_paired

        result = run_paired_learning(args.url, prompts, args.pair_learning, args.max_tokens, args.concurrency[0],
                                     chat=not args.raw, api_key=args.api_key, progress=print_round)
        report_paired(result, args.out, args.markdown)
        return
    result = run_load(args.url, prompts, args.max_tokens, tuple(args.concurrency), chat=not args.raw,
                      api_key=args.api_key)
    report_load(result, args.out, args.markdown)
