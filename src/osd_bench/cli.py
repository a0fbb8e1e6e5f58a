"""`osd demo`, `osd replay` and `osd bench ...`: the evidence harness's commands, registered on the `osd` parser.

osd's CLI finds this module through the `osd.commands` entry point (pyproject.toml), so the product never imports the
harness. Parse -> config -> call the harness. No logic here.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from osd.config import ModelConfig, SpeculationConfig
from osd.flags import add_config_flags, config_from
from osd_bench.readme import add_arguments as readme_arguments, run as readme_run


def cmd_demo(args) -> None:
    from osd_bench.demo import run_demo

    run_demo(config_from(args, ModelConfig), config_from(args, SpeculationConfig), args.max_new_tokens)


def cmd_bench_speed(args) -> None:
    from osd_bench.speed import run_speed
    from osd_bench.report import report_speed

    result = run_speed(config_from(args, ModelConfig), config_from(args, SpeculationConfig), args.per_domain,
                       args.max_new_tokens, llama_cpp=not args.no_llama_cpp, hf_baseline=args.hf_baseline,
                       spec_k=args.llama_cpp_spec_k, osd_q4=not args.no_osd_q4, learned_draft=args.learned_draft,
                       domains=tuple(d for d in args.domains.split(",") if d), offset=args.offset,
                       only=tuple(a for a in args.arms.split(",") if a), busy_calibration=args.busy_calibration)
    report_speed(result, args.out, args.markdown)


def cmd_bench_rows(args) -> None:
    from osd_bench.report import report_rows
    from osd_bench.rows import run_rows

    backends = tuple(b for b in args.backends.split(",") if b)
    report_rows(run_rows(args.target, args.threads, args.context, args.repeats, backends), args.out, args.markdown)


def cmd_bench_passes(args) -> None:
    from osd_bench.passes import run_passes
    from osd_bench.report import report_passes

    ints = lambda text: tuple(int(x) for x in text.split(",") if x)  # noqa: E731
    report_passes(run_passes(args.target, ints(args.contexts), ints(args.sequences), ints(args.rows_each),
                             args.repeats, args.threads), args.out, args.markdown)


def cmd_bench_calibration(args) -> None:
    from osd_bench.calibration import run_calibration
    from osd_bench.report import report_calibration

    report_calibration(run_calibration(args.times, args.repeats, args.max_batch, args.threads), args.out, args.markdown)


def cmd_bench_pair(args) -> None:
    from osd_bench.pair import report_pair

    report_pair(args.a, args.b, args.out, args.markdown)


def cmd_bench_evidence(args) -> None:
    from osd_bench.evidence import report_evidence

    report_evidence(args.results, args.out, args.markdown)


def cmd_bench_observe(args) -> None:
    from osd_bench.observe import run_observe
    from osd_bench.report import report_observe

    result = run_observe(tuple(args.proposals), args.context, args.vocab, args.top_k, repeats=args.repeats,
                         seed=args.seed)
    report_observe(result, args.out, args.markdown)


def cmd_bench_train_step(args) -> None:
    from tqdm import tqdm

    from osd_bench.report import report_train_step
    from osd_bench.train_step import run_train_step
    from osd.distill.cache import DecodeSettings

    result = run_train_step(config_from(args, ModelConfig), args.dataset, args.split, args.requests,
                            DecodeSettings(max_new_tokens=args.max_new_tokens, top_k=args.top_k), args.train_layers,
                            args.trainable, args.batch_size, args.repeats, cache_dir=args.cache_dir, progress=tqdm)
    report_train_step(result, args.out, args.markdown)


def cmd_replay(args) -> None:
    from tqdm import tqdm

    if args.from_result:  # re-render a finished live replay's report and plots; measures nothing
        from osd.records import read_result
        from osd_bench.replay import report_live_comparison
        from osd_bench.report import report_replay

        result = read_result(args.from_result, needs=("config", "requests", "learner", "metrics_by_draft_version"))
        report_replay(result, args.from_result, args.markdown, args.window)
        return report_live_comparison(result, args.from_result, args.markdown, args.window)
    if args.route:
        return cmd_replay_routed(args)
    if args.fast:
        return cmd_replay_fast(args)
    from osd_bench.report import report_replay
    from osd_bench.replay import report_live_comparison, run_replay
    from osd.learn.online import LearnConfig

    result = run_replay(config_from(args, ModelConfig), config_from(args, SpeculationConfig), config_from(args, LearnConfig),
                        args.stream, args.split, args.per_segment, args.max_new_tokens, not args.no_baseline,
                        progress=lambda it: tqdm(it, desc="replay", unit="req"), target_only=args.target_only,
                        heldout=args.heldout, heldout_split=args.heldout_split, llama_cpp_target=args.llama_cpp_target,
                        compare_every=args.compare_every)
    report_replay(result, args.out, args.markdown, args.window)
    report_live_comparison(result, args.out, args.markdown, args.window)


def cmd_replay_fast(args) -> None:
    from tqdm import tqdm

    from osd_bench.replay_fast import run_fast_replay
    from osd_bench.replay_fast_report import report_fast_replay
    from osd.distill.cache import DecodeSettings
    from osd.learn.online import LearnConfig

    learn = config_from(args, LearnConfig)
    rows_path = Path(args.out).with_suffix(".rows.jsonl")  # each request's row as it is measured
    state_path = Path(args.state or Path(args.out).with_suffix(".state.pt"))  # a rerun of a cut run continues
    if args.fresh:
        state_path.unlink(missing_ok=True)
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    with rows_path.open("w") as rows_file:  # a resumed run writes the restored rows first
        def on_row(row):
            rows_file.write(json.dumps(row) + "\n")
            rows_file.flush()

        result = run_fast_replay(config_from(args, ModelConfig), learn, args.stream, args.split, args.per_segment,
                                 DecodeSettings(max_new_tokens=args.max_new_tokens, top_k=learn.top_k), args.k,
                                 not args.no_baseline, args.baseline_epochs, args.baseline_lr, args.overlap,
                                 batch_size_generate=args.batch_size_generate, cache_dir=args.cache_dir, progress=tqdm,
                                 heldout=args.heldout, heldout_split=args.heldout_split, on_row=on_row,
                                 state_path=state_path, save_every=args.save_every,
                                 baseline_arrival=args.baseline_arrival)
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in result["requests"]))  # now with the baselines' columns
    report_fast_replay(result, args.out, args.markdown, args.window)
    if not args.keep_state:
        state_path.unlink(missing_ok=True)  # finished: the result JSON holds everything


def cmd_replay_routed(args) -> None:
    from tqdm import tqdm

    from osd_bench.replay_routed import run_routed_replay
    from osd_bench.replay_routed_report import report_routed_replay
    from osd.distill.cache import DecodeSettings
    from osd.errors import InvalidArgument
    from osd.learn.online import LearnConfig
    from osd.route.config import RouteConfig

    if not args.fast:
        raise InvalidArgument("--route runs on the greedy fast path: add --fast")
    learn = config_from(args, LearnConfig)
    rows_path = Path(args.out).with_suffix(".rows.jsonl")
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    with rows_path.open("w") as rows_file:
        def on_row(row):
            rows_file.write(json.dumps(row) + "\n")
            rows_file.flush()

        result = run_routed_replay(config_from(args, ModelConfig), learn, config_from(args, RouteConfig), args.stream,
                                   args.split, args.per_segment, DecodeSettings(max_new_tokens=args.max_new_tokens,
                                                                                top_k=learn.top_k), args.k,
                                   args.heldout, args.heldout_split, args.batch_size_generate, args.cache_dir, tqdm,
                                   seed=learn.seed, on_row=on_row, fork_at=args.fork_at,
                                   residual=args.residual)
    report_routed_replay(result, args.out, args.markdown, args.window)


def cmd_bench_soak(args) -> None:
    from osd_bench.soak import SoakConfig
    from osd_bench.soak_report import report_soak
    from osd_bench.soak_server import run_soak_command
    from osd.data import load_records
    from osd.errors import InvalidArgument

    if args.clients < 1 or args.minutes <= 0:
        raise InvalidArgument("bench soak needs --clients >= 1 and --minutes > 0")
    prompts = [r["prompt"][: args.max_prompt_chars] for r in load_records(args.prompts, split=args.split or None,
                                                                            limit=args.limit)]
    if not prompts:
        raise InvalidArgument(f"no prompts in {args.prompts!r}")
    config = SoakConfig(clients=args.clients, seconds=60 * args.minutes, seed=args.seed, pause=args.pause,
                        warmup_rounds=args.warmup_rounds, warmup_updates=args.warmup_updates)
    result = run_soak_command(args.models, prompts, args.max_tokens, config, url=args.url, api_key=args.api_key,
                              pid=args.pid, max_body_bytes=args.max_body_bytes, serve_args=args.serve_arg or [],
                              log_path=str(Path(args.out).with_suffix(".server.log")))
    report_soak(result, args.out, args.markdown)


def cmd_bench_serve_vs(args) -> None:
    import shlex

    from osd_bench.serve_compare import CompareConfig, interleaved_prompts, long_prompt, run_compare
    from osd_bench.serve_report import report_vs
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
    from osd_bench.serve_load import run_load
    from osd_bench.serve_report import report_load

    prompts = [r["prompt"] for r in load_records(args.prompts, split=args.split or None, limit=args.limit)]
    if not prompts or min(args.concurrency) < 1:
        raise InvalidArgument("bench serve needs at least one prompt and concurrency levels >= 1")
    if args.pair_learning:
        from osd_bench.serve_load import run_paired_learning
        from osd_bench.serve_report import print_round, report_paired

        result = run_paired_learning(args.url, prompts, args.pair_learning, args.max_tokens, args.concurrency[0],
                                     chat=not args.raw, api_key=args.api_key, progress=print_round)
        report_paired(result, args.out, args.markdown)
        return
    result = run_load(args.url, prompts, args.max_tokens, tuple(args.concurrency), chat=not args.raw,
                      api_key=args.api_key)
    report_load(result, args.out, args.markdown)


def cmd_bench_readme(args) -> None:
    code = readme_run(args)
    if code:
        raise SystemExit(code)


def register(sub) -> None:
    """Add `osd demo`, `osd replay` and `osd bench ...` to the `osd` parser (sub)."""
    p = sub.add_parser("demo", help="the main job on the bundled pair: a few real prompts, osd vs target-only")
    p.add_argument("--max-new-tokens", type=int, default=48)
    for cls in (ModelConfig, SpeculationConfig):
        add_config_flags(p, cls)
    p.set_defaults(func=cmd_demo)

    from osd.learn.online import LearnConfig

    p = sub.add_parser("replay", help="replay a prompt stream through the online system; alpha vs requests")
    p.add_argument("--stream", default="gsm8k", help="dataset, or a comma list for a sharp shift (gsm8k,spider,code); "
                   "name:split gives a dataset its own split (finance:test)")
    p.add_argument("--split", default="train")
    p.add_argument("--per-segment", type=int, default=40, help="requests per dataset")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--no-baseline", action="store_true", help="skip the offline baselines (10%%/100%% of the stream, "
                   "equal optimizer steps); the never-trained control is always measured")
    p.add_argument("--target-only", action="store_true", help="live: also decode each request with the target alone")
    p.add_argument("--llama-cpp-target", action="store_true", help="live: also decode each request with llama.cpp alone "
                   "on the target's GGUF (tokens/s side by side)")
    p.add_argument("--compare-every", type=int, default=1, metavar="N", help="live: the control, --target-only and "
                   "--llama-cpp-target decode every Nth request only (the online draft serves every one), so that a long "
                   "stream fits in an hour; ratios to them use the online tok/s on the same requests")
    p.add_argument("--from-result", default="", metavar="JSON", help="live: measure nothing; re-render a finished "
                   "replay's report, plots (and, with --markdown, blocks) from its JSON (the recorded command, revision and "
                   "machine are kept)")
    p.add_argument("--fast", action="store_true", help="greedy fast path from the target-output cache (exact; hundreds of requests)")
    p.add_argument("--route", action="store_true", help="--fast on an interleaved stream: one shared online draft, per-mode "
                   "drafts with the router, per-label drafts (oracle split) and the control, in one run (RouteConfig flags; "
                   "name@lang streams one language: multilingual_qa@de)")
    p.add_argument("--baseline-epochs", type=int, default=0, help="> 0: also the epochs recipe on 100%% of the stream "
                   "(its own, labelled draft; not equal steps)")
    p.add_argument("--baseline-arrival", action="store_true", help="--fast: also an equal-step offline draft on 100%% of "
                   "the stream whose step t draws only from the requests that had arrived by then (what the online "
                   "setting costs, apart from the online learner's recipe)")
    p.add_argument("--baseline-lr", type=float, default=1e-5, help="learning rate of the epochs recipe (the equal-step "
                   "baselines use --lr)")
    p.add_argument("--overlap", type=float, default=0.0, help="--fast: 0 = sharp switches; > 0 = gradual drift over this many segments")
    p.add_argument("--batch-size-generate", type=int, default=16, help="--fast: prompts per target forward when filling the cache")
    p.add_argument("--cache-dir", default=None, help="--fast: target-output cache root")
    p.add_argument("--heldout", type=int, default=40, help="at the end, also measure every draft on this many unseen "
                   "requests per dataset, each paired with the control (0 = none)")
    p.add_argument("--heldout-split", default="test", help="split of the held-out requests (the stream's own split: "
                   "the ones after the streamed requests)")
    p.add_argument("--state", default="", help="--fast: resumable state file (default <out>.state.pt); a rerun of a "
                   "cut run continues from it; removed when the run finishes unless --keep-state")
    p.add_argument("--keep-state", action="store_true", help="--fast: keep the state file after the run finishes, so "
                   "the same command with another baseline option (--baseline-arrival, --baseline-epochs) trains only "
                   "that draft instead of replaying the stream again")
    p.add_argument("--save-every", type=int, default=25, help="--fast: save the state every this many requests")
    p.add_argument("--fresh", action="store_true", help="--fast: discard a saved state and start over")
    p.add_argument("--window", type=int, default=10, help="moving-average window of the plot")
    p.add_argument("--fork-at", type=int, default=0, help="--route: the shared draft serves every arm for this many "
                   "requests, then the per-mode and per-label drafts start as copies of it (a split); 0 = they start "
                   "from the base")
    p.add_argument("--residual", action="store_true", help="--route: the per-label and per-mode drafts are residuals "
                   "on the shared draft (each = the shared draft plus its own steps on its traffic; learn/residual.py); "
                   "adds one shared draft with the same total optimizer steps as a control")
    p.add_argument("--out", default="benchmarks/replay/replay.json", help="result JSON (and PNG beside it); --fast also writes "
                   "each request's row to <out>.rows.jsonl as it is measured, so a run cut short keeps them")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    from osd.route.config import RouteConfig

    for cls in (ModelConfig, SpeculationConfig, LearnConfig, RouteConfig):
        add_config_flags(p, cls)
    p.set_defaults(func=cmd_replay, adaptive=False)  # replay: a fixed k unless --adaptive (live alpha at one k)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("speed", help="tokens/s: llama.cpp vs osd (vs transformers), same prompts, one run")
    p.add_argument("--per-domain", type=int, default=2, help="prompts per domain (code, gsm8k, spider, chat)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp arms")
    p.add_argument("--hf-baseline", action="store_true", help="add transformers' fp32 target-only greedy (slow; "
                   "converts the GGUF to fp32 once)")
    p.add_argument("--llama-cpp-spec-k", type=int, default=4, help="k of the llama.cpp-drafted arm")
    p.add_argument("--no-osd-q4", action="store_true", help="skip the arms on osd's own Q4_K kernel (osd_q4*)")
    p.add_argument("--learned-draft", default="", help="a learner's checkpoint directory (osd serve / osd replay "
                   "--checkpoint-dir) on the same --draft: adds osd_q4_learned, the learned draft beside the original")
    p.add_argument("--domains", default="code,gsm8k,spider,chat", help="comma list of the prompt datasets")
    p.add_argument("--offset", type=int, default=0, help="first record of each dataset's test split (skip the "
                   "requests a --learned-draft trained on)")
    p.add_argument("--arms", default="", help="comma list: time only these arms (and the baseline and references)")
    p.add_argument("--busy-calibration", type=int, default=0, metavar="N", help="N processes spin on the CPU while "
                   "each osd_q4* arm calibrates (none while anything decodes): does the k policy recover from costs "
                   "measured on a busy machine?")
    p.add_argument("--out", default="benchmarks/speed/bench-speed.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    for cls in (ModelConfig, SpeculationConfig):
        add_config_flags(p, cls)
    p.set_defaults(func=cmd_bench_speed)
    p = bench.add_parser("rows", help="cost of verifying 1..9 tokens in one target forward, per backend")
    p.add_argument("--target", default=ModelConfig.target)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", default="llama.cpp,llama.cpp-norepack,osd",
                   help="comma-separated: llama.cpp (repacked Q4_K), llama.cpp-norepack, osd (own Q4_K kernel)")
    p.add_argument("--out", default="benchmarks/kernel/bench-rows.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    p.set_defaults(func=cmd_bench_rows)
    p = bench.add_parser("passes", help="cost of one target pass by rows, sequences and cached context (osd's Q4 "
                         "kernel), against the scheduler's cost model fitted on it")
    p.add_argument("--target", default=ModelConfig.target)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--contexts", default="64,500", help="comma list: cached tokens of every sequence")
    p.add_argument("--sequences", default="1,2,4,8", help="comma list: sequences in a pass")
    p.add_argument("--rows-each", default="1,2,4,8", help="comma list: rows of each sequence")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/kernel/bench-passes.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    p.set_defaults(func=cmd_bench_passes)
    p = bench.add_parser("calibration", help="how repeatable a server's startup calibration is (a target pass by rows "
                         "against one row, what the k decisions read), read by each estimator from the same rounds")
    p.add_argument("--times", type=int, default=6, help="calibrations")
    p.add_argument("--repeats", type=int, default=6, help="engine.calibrate's repeats (timed rounds - 1)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/kernel/bench-calibration.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    p.set_defaults(func=cmd_bench_calibration)
    p = bench.add_parser("evidence", help="held-out table of finished fast replays (control, online, equal-step offline "
                         "drafts, paired z) with the learning targets' verdicts and a bar chart; re-measures nothing")
    p.add_argument("results", nargs="+", help="result JSON files of `osd replay --fast --heldout N`")
    p.add_argument("--out", default="benchmarks/learning/evidence.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    p.set_defaults(func=cmd_bench_evidence)
    p = bench.add_parser("pair", help="two finished fast replays of one stream (one learner setting apart), paired on "
                         "the same held-out positions: B's online draft against A's, with the sign-test z")
    p.add_argument("a", help="result JSON of `osd replay --fast --heldout N` (the reference)")
    p.add_argument("b", help="the same replay with one setting changed")
    p.add_argument("--out", default="benchmarks/learning/pair.json")
    p.add_argument("--markdown", default="", help="also append the table to this markdown file (default: none)")
    p.set_defaults(func=cmd_bench_pair)
    p = bench.add_parser("observe", help="what a learning server's serving thread spends per sequence-step handing the "
                                         "learner the verified rows (top-k of the target's logits), by proposals")
    p.add_argument("--proposals", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--context", type=int, default=300, help="committed tokens before the step")
    p.add_argument("--vocab", type=int, default=151936, help="the target's vocabulary (the bundled Qwen2.5's)")
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/learning/bench-observe.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    p.set_defaults(func=cmd_bench_observe)
    p = bench.add_parser("train-step", help="seconds per draft distillation step: whole last layer vs rows only")
    p.add_argument("--dataset", default="spider")
    p.add_argument("--split", default="train")
    p.add_argument("--requests", type=int, default=16, help="cached requests to draw batches from")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--top-k", type=int, default=64, help="target distribution kept per position (cache key)")
    p.add_argument("--cache-dir", default=None, help="teacher cache (default ~/.cache/osd/teacher)")
    p.add_argument("--train-layers", type=int, default=2)
    p.add_argument("--trainable", default="no_embeddings")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/learning/bench-train-step.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    add_config_flags(p, ModelConfig)
    p.set_defaults(func=cmd_bench_train_step)
    from osd_bench.kernel import register as register_bench_kernel  # `osd bench kernel`

    register_bench_kernel(bench)
    from osd_bench.teacher import register as register_bench_teacher  # `osd bench teacher`

    register_bench_teacher(bench)
    from osd_bench.target_quant import register as register_bench_target_quant  # `osd bench target-quant`

    register_bench_target_quant(bench)
    from osd_bench.feature_head_run import register as register_bench_feature_head  # `osd bench feature-head`

    register_bench_feature_head(bench)
    from osd_bench.synth_gguf import register as register_bench_synth_gguf  # `osd bench synth-gguf`

    register_bench_synth_gguf(bench)
    from osd_bench.scale import register as register_bench_scale  # `osd bench scale` (imports Ray when run)
    from osd_bench.live import register as register_bench_live  # `osd bench live`

    register_bench_scale(bench)
    register_bench_live(bench)

    p = bench.add_parser("soak", help="N concurrent clients for M minutes against a live `osd serve`: valid and invalid "
                         "requests, disconnects; every answer checked (greedy = target-only), RSS, threads, learner")
    p.add_argument("--models", choices=("tiny", "bundled"), default="bundled",
                   help="the pair the server runs (tiny: seeded random models written to ~/.cache/osd/tiny); the "
                   "target-only reference uses its target")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--url", default=None, help="drive this running server (serving --models) instead of starting one")
    p.add_argument("--api-key", default=None, help="with --url: the server's key (default none)")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's process id, for RSS and threads")
    p.add_argument("--prompts", default="chat", help="dataset name (shared/datasets) or JSONL path")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=4, help="distinct prompts")
    p.add_argument("--max-prompt-chars", type=int, default=200, help="prompts cut to this many characters")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-body-bytes", type=int, default=1_000_000, help="the server's body limit (oversized = one more)")
    p.add_argument("--serve-arg", action="append", default=None,
                   help="(repeatable) extra flag for the started `osd serve`, e.g. --serve-arg=--no-learn")
    p.add_argument("--pause", type=float, default=0.0, help="seconds each client waits between requests (0 = saturate)")
    p.add_argument("--warmup-rounds", type=int, default=1, help="before RSS is first taken, each client sends every "
                   "valid kind this many times at once (not counted; 0 = one request of each kind, one at a time)")
    p.add_argument("--warmup-updates", type=int, default=1, help="... and more such rounds until the server's learner "
                   "has published this many updates, so RSS start holds its training working set (0 = do not wait)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/soak/bench-soak.json", help="result JSON (the server's log beside it)")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    p.set_defaults(func=cmd_bench_soak)
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
    p.add_argument("--out", default="benchmarks/serve/bench-serve.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
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
                   choices=["llama-server", "llama-server-native", "osd", "osd-learning", "osd-target-only", "osd-avx2",
                            "osd-target-only-avx2"],
                   help="llama-server: built with the portable AVX2 flags of llama-cpp-python's wheel; "
                        "llama-server-native: built for this CPU (-DGGML_NATIVE=ON, AVX-512 where it has it), as "
                        "llama.cpp builds by default; both once per machine, cached")
    p.add_argument("--osd-args", default="--lookup", help="more `osd serve` flags for every osd arm (one string)")
    p.add_argument("--prefill-chars", type=int, default=4000,
                   help="also time each server's prefill of one long prompt of about this many characters (~1,000 "
                        "tokens of code test prompts; 0 = skip)")
    p.add_argument("--out", default="benchmarks/serve/bench-serve-vs.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    p.set_defaults(func=cmd_bench_serve_vs)
    p = bench.add_parser("readme", help="rewrite the README's results block and benchmarks/INDEX.md from the result "
                         "files benchmarks/index.json names (--check: exit 1 where they differ)")
    readme_arguments(p)
    p.set_defaults(func=cmd_bench_readme)
