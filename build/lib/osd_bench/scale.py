"""`osd bench scale`: 1 vs 2 (vs N) serving replicas on Ray with one learner, on this machine, the same prompts and
load for every arm: aggregate tokens/s, the learner's samples per second and bytes per sample, publish-to-swap
latency per replica, RSS per replica and of the learner, Ray's own cost (start time, idle RSS); and a projection
past this machine, computed from those measured inputs and marked as a model.

The bench process is the HTTP front (the same app `osd serve --replicas` runs), so it holds the actors' handles: it
times a publish (`publish_now`) and reads each process's memory. Each arm starts Ray afresh and stops it after."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from osd.records import emit_report, write_result
from osd_bench.serve_compare import run_level, summarise_level
from osd_bench.serve_load import _client, _request_body, one_request
from osd.flags import add_config_flags, config_from
from osd.serve.threaded import serve_in_thread


@dataclasses.dataclass
class ScaleConfig:
    models: object  # ModelConfig (threads = each replica's)
    spec: object  # SpeculationConfig
    learn: object | None  # LearnConfig (None: no learner)
    prompts: list[str]
    replicas: tuple[int, ...] = (1, 2)
    threads: tuple[int, ...] = (1, 1)  # each arm's threads per replica (paired with replicas)
    concurrency: int = 8
    max_tokens: int = 64
    osd_args: tuple[str, ...] = ()  # the flags of every arm, for the no-Ray arm's `osd serve` (0 replicas)


def run_arm(config: ScaleConfig, n: int, threads: int) -> tuple[dict, list]:
    import ray

    from osd.cluster.launch import connect, start_cluster
    from osd.memory import system_rss_bytes
    from osd.models.loading import load_tokenizer
    from osd.serve.app import create_app

    before = system_rss_bytes()
    ray_start = connect()
    ray_idle = system_rss_bytes() - before
    cluster = start_cluster(dataclasses.replace(config.models, threads=threads), config.spec, config.learn, n)
    app = create_app(None, load_tokenizer(config.models.target), "osd", learner=cluster.learner, pool=cluster.pool)
    learner = cluster.pool.learner_actor
    try:
        with serve_in_thread(app, ready_timeout=120) as url:
            record, texts = asyncio.run(_load(url, config, n))
            got = ray.get(learner.stats.remote()) if learner is not None else {}
            record["publish"] = _time_publish(cluster.pool) if learner is not None else None
            replicas = [ray.get(h.stats.remote()) for h in cluster.pool.replicas]
            learned = ray.get(learner.stats.remote()) if learner is not None else {}
    finally:
        cluster.pool.stop(timeout=30)
        if cluster.learner is not None:
            cluster.learner.stop()
        ray.shutdown()
    wall = record["wall_seconds"]
    record.update(replicas=n, threads=threads, ray_start_seconds=ray_start, ray_idle_rss_bytes=ray_idle,
                  replicas_ready_seconds=cluster.ready_seconds,
                  replica_peak_rss_bytes=[r.get("peak_rss_bytes") for r in replicas],
                  samples_dropped=sum(r.get("samples_dropped", 0) for r in replicas),
                  learner={key: learned.get(key) for key in ("peak_rss_bytes", "samples_received", "sample_bytes_received",
                                                             "requests_received", "submit_seconds", "updates_published",
                                                             "updates_rejected", "optimizer_steps", "train_seconds",
                                                             "version", "samples_by_replica", "draft_copy")}
                  if learner else None, draft_copies=[r.get("draft_copy") for r in replicas])
    if got:  # samples that arrived while the load ran, and what the learner had done by the load's end
        record["learner_at_load_end"] = {k: got.get(k) for k in ("optimizer_steps", "train_seconds", "updates_published")}
        record["learner_samples_per_s"] = got["samples_received"] / wall if wall else None
        record["bytes_per_sample"] = got["sample_bytes_received"] / got["samples_received"] if got["samples_received"] else None
    return record, texts


def run_plain_arm(config: ScaleConfig, threads: int) -> tuple[dict, list]:
    """The same load on one `osd serve` process without Ray (its own main thread runs the model): what Ray costs."""
    import shutil
    import sys
    import tempfile

    from osd_bench.llama_server import running
    from osd_bench.serve_compare import peak_rss_bytes
    from osd_bench.soak_server import free_port

    port, logs = free_port(), Path(tempfile.mkdtemp(prefix="osd-scale-plain-"))
    osd = shutil.which("osd", path=str(Path(sys.executable).parent)) or "osd"
    command = [osd, "serve", "--port", str(port), "--threads", str(threads), "--checkpoint-dir", str(logs / "ckpt"),
               *config.osd_args, *([] if config.learn is not None else ["--no-learn"])]
    with running(command, f"http://127.0.0.1:{port}", logs / "serve.log") as process:
        record, texts = asyncio.run(_load(f"http://127.0.0.1:{port}", config, 1))
        if config.learn is not None:  # what its learner did meanwhile (the Ray arms' learner stats, for comparison)
            import httpx

            state = httpx.get(f"http://127.0.0.1:{port}/v1/osd/learner", timeout=30).json()
            record["learner_at_load_end"] = {k: state.get(k) for k in ("optimizer_steps", "train_seconds",
                                                                       "updates_published")}
        record.update(replicas=0, threads=threads, command=" ".join(command), ray_start_seconds=None,
                      ray_idle_rss_bytes=None, replica_peak_rss_bytes=[peak_rss_bytes(process.pid)], publish=None)
    return record, texts


async def _load(url: str, config: ScaleConfig, n: int) -> tuple[dict, list]:
    async with _client(url, None, 1800.0, config.concurrency + 2) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        # one warm-up request per replica (least-loaded: each takes one), not counted
        await asyncio.gather(*(one_request(client, *_request_body(model, config.prompts[0], 8, True)) for _ in range(n)))
        samples, wall = await run_level(client, model, config.prompts, config.max_tokens, config.concurrency)
    record = summarise_level(f"osd x{n}", config.learn is not None, config.concurrency, [s for _, s in samples], wall,
                             None, {})
    print(f"  {n} replica(s): {record['aggregate_tokens_per_s']:.1f} tok/s, TTFT p50 {record['ttft_p50_s'] or 0:.2f} s, "
          f"errors {record['errors']}", flush=True)
    return record, [s.text if s.ok else None for _, s in samples]


def _time_publish(pool, timeout: float = 60.0) -> dict:
    """Publish once and wait until every replica serves it: seconds to the last replica, and each replica's own."""
    import ray

    start = time.perf_counter()
    version = ray.get(pool.learner_actor.publish_now.remote())
    while True:
        states = [ray.get(h.stats.remote()) for h in pool.replicas]
        if all(s["version"] >= version for s in states) or time.perf_counter() - start > timeout:
            break
        time.sleep(0.02)
    return {"version": version, "all_replicas_seconds": time.perf_counter() - start,
            "publish_to_swap_seconds": [s["last_swap"]["publish_to_swap_seconds"] for s in states],
            "payload_bytes": ray.get(pool.learner_actor.stats.remote()).get("publish_bytes")}


def projection(records: list[dict]) -> dict | None:
    """A model, not a measurement: how far one learner carries, from the widest arm's measured inputs."""
    r = max((r for r in records if r.get("learner") and r["learner"].get("samples_received")), key=lambda r: r["replicas"],
            default=None)
    if r is None:
        return None
    learner, n, wall = r["learner"], r["replicas"], r["wall_seconds"]
    per_replica = r["learner_samples_per_s"] / n
    ingest = learner["submit_seconds"] / learner["samples_received"]
    return {"from_replicas": n, "samples_per_s_per_replica": per_replica,
            "bytes_per_sample": r["bytes_per_sample"],
            "network_bytes_per_s_per_replica": per_replica * r["bytes_per_sample"],
            "learner_ingest_seconds_per_sample": ingest,
            "replicas_one_learner_ingests": 1.0 / (ingest * per_replica) if ingest and per_replica else None,
            "publish_payload_bytes": (r.get("publish") or {}).get("payload_bytes"),
            "note": "model: one learner keeps up while the samples all replicas ship take less than its time "
                    "(ingest only; training draws batches from the buffer and does not need every sample)"}


def run_scale(config: ScaleConfig) -> dict:
    records, texts = [], {}
    arms = [f"{n}x{t}" for n, t in zip(config.replicas, config.threads)]
    for arm, n, t in zip(arms, config.replicas, config.threads):
        print(f"[scale] {n} replica(s) x {t} thread(s), {config.concurrency} clients, {len(config.prompts)} requests",
              flush=True)
        record, texts[arm] = run_arm(config, n, t) if n else run_plain_arm(config, t)
        records.append(record)
    identity = {arm: {"same": sum(a is not None and a == b for a, b in zip(texts[arm], texts[arms[0]])),
                      "of": len(texts[arms[0]])} for arm in arms[1:]}
    return {"records": records, "identity_vs_first_arm": identity, "projection": projection(records)}


def register(bench) -> None:
    p = bench.add_parser("scale", help="1 vs 2 serving replicas on Ray with one learner, same prompts: tokens/s, "
                         "samples shipped, publish-to-swap latency, memory, Ray's own cost; and a projection")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2],
                   help="replicas of each arm; 0 = one `osd serve` process without Ray (what Ray costs)")
    p.add_argument("--threads", type=int, nargs="+", default=[1],
                   help="threads of each replica: one value for every arm, or one per --replicas arm (e.g. --replicas "
                        "1 2 1 --threads 1 1 2: the last arm is one replica on both cores)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--osd-args", default="--lookup", help="osd serve flags for every arm's replicas (one string)")
    p.add_argument("--no-learn", action="store_true", help="replicas only, no learner")
    p.add_argument("--faults", action="store_true",
                   help="instead: a Ray cluster started apart, `osd serve --replicas 2 --ray-address auto`, and under "
                        "load in turn no fault, kill -9 of a replica, of the learner, of the front (started again): "
                        "answered / failed / hung requests per phase and the recovery (bench/scale_faults.py)")
    p.add_argument("--replay", type=int, default=0, metavar="N",
                   help="instead: a fast greedy replay of one stream split across N simulated replicas, one learner fed "
                        "by all vs each learning alone, held-out alpha against the never-trained control "
                        "(bench/scale_replay.py; --replay-dataset, --per-replica)")
    p.add_argument("--replay-dataset", default="gsm8k")
    p.add_argument("--per-replica", type=int, default=80, help="--replay: requests each simulated replica serves")
    p.add_argument("--out", default="benchmarks/bench-scale.json")
    p.add_argument("--markdown", default="BENCHMARKS.md", help="append a summary here ('' = no)")
    p.set_defaults(func=_cmd)


def _cmd(args) -> None:
    import argparse
    import shlex
    import tempfile

    from osd_bench.serve_compare import interleaved_prompts
    from osd.config import ModelConfig, SpeculationConfig
    from osd.errors import InvalidArgument
    from osd.learn.online import LearnConfig

    if args.faults:
        return _cmd_faults(args)
    flags = argparse.ArgumentParser(add_help=False)
    for cls in (ModelConfig, SpeculationConfig, LearnConfig):
        add_config_flags(flags, cls)
    flags.set_defaults(max_batch=8, busy_share=0.05, schedule="background")  # as `osd serve`
    if args.replay:  # the evidence table's recipe (BENCHMARKS.md), synchronous updates
        flags.set_defaults(schedule="sync", mode="all", lr=1e-4, train_layers=2, rehearsal=0.5, average=0.98)
    osd = flags.parse_args(shlex.split(args.osd_args))
    if args.replay:
        return _cmd_replay(args, config_from(osd, ModelConfig), config_from(osd, LearnConfig))
    threads = args.threads * len(args.replicas) if len(args.threads) == 1 else args.threads
    if len(threads) != len(args.replicas):
        raise InvalidArgument("--threads takes one value, or one per --replicas arm")
    models = config_from(osd, ModelConfig)
    learn = None if args.no_learn else dataclasses.replace(config_from(osd, LearnConfig),
                                                            checkpoint_dir=tempfile.mkdtemp(prefix="osd-scale-"))
    config = ScaleConfig(models, config_from(osd, SpeculationConfig), learn, interleaved_prompts(args.requests + 1)[1:],
                         tuple(args.replicas), tuple(threads), args.concurrency, args.max_tokens,
                         tuple(shlex.split(args.osd_args)))
    result = run_scale(config)
    result["config"] = {"replicas": list(args.replicas), "threads": threads, "requests": args.requests,
                        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "osd_args": args.osd_args,
                        "learning": learn is not None, "temperature": 0}
    report_scale(result, args.out, args.markdown)


def _cmd_replay(args, models, learn) -> None:
    from tqdm import tqdm

    from osd_bench.scale_replay import run_split_replay

    models = dataclasses.replace(models, threads=0)  # the replay runs in this process, on every core
    result = run_split_replay(models, learn, args.replay_dataset, args.per_replica, args.replay, progress=tqdm)
    result["config"] = {"learn": dataclasses.asdict(learn), "draft": models.draft, "osd_args": args.osd_args}
    path = write_result(result, args.out.replace(".json", "-replay.json") if args.out.endswith(".json") else args.out)
    z = lambda d: f"{d['gained']}/{d['lost']}, z {d['z']:.1f}"
    rows = ["| draft | held-out alpha | vs never-trained (gained/lost, z) | pooled vs it (gained/lost, z) | optimizer steps |",
            "|---|---|---|---|---|",
            f"| never trained (control) | {result['control_alpha']:.3f} | - | - | 0 |",
            f"| one learner fed by all {args.replay} replicas ({args.replay * args.per_replica} requests) | "
            f"{result['pooled']['alpha']:.3f} | {z(result['pooled']['vs_control'])} | - | "
            f"{result['pooled']['optimizer_steps']} |"]
    for a in result["alone"]:
        rows.append(f"| replica {a['replica']} learning alone ({args.per_replica} requests) | {a['alpha']:.3f} | "
                    f"{z(a['vs_control'])} | {z(a['pooled_vs_this'])} | {a['optimizer_steps']} |")
    emit_report("Scale-out on Ray: one learner fed by N replicas vs each alone (osd bench scale --replay)",
                f"`osd bench scale --replay {args.replay}` ({args.replay_dataset} train stream, {args.per_replica} "
                f"requests per simulated replica, held-out: {result['heldout_positions']} positions of the first 40 "
                f"test requests; draft {models.draft}; fast greedy replay, synchronous updates)", ["\n".join(rows)],
                Path(path), args.markdown)


def _cmd_faults(args) -> None:
    import shlex

    from osd_bench.scale_faults import FAULTS, run_faults
    from osd_bench.serve_compare import interleaved_prompts

    result = run_faults(shlex.split(args.osd_args), interleaved_prompts(args.requests * len(FAULTS) + 1)[1:],
                        args.requests, args.concurrency, args.max_tokens)
    result["config"] = {"requests_per_phase": args.requests, "concurrency": args.concurrency,
                        "max_tokens": args.max_tokens, "osd_args": args.osd_args, "replicas": 2, "threads": 1}
    path = write_result(result, args.out.replace(".json", "-faults.json") if args.out.endswith(".json") else args.out)
    rows = ["| fault | answered | failed (clear error) | hung | back in s | replica versions after | learner version |",
            "|---|---|---|---|---|---|---|"]
    for p in result["phases"]:
        back = "-" if p["recovered_seconds"] is None else f"{p['recovered_seconds']:.1f}"
        rows.append(f"| {p['fault']} | {p['ok']}/{p['requests']} | {p['errors']} | {p['hung']} | {back} | "
                    f"{p['replica_versions']} | {p['learner_version']} |")
    notes = [f"- {p['fault']}: {'; '.join(p['error_examples'])}" for p in result["phases"] if p["error_examples"]]
    emit_report("Scale-out on Ray: faults under load (osd bench scale --faults)",
                f"`osd bench scale --faults` ({args.requests} requests per phase, {args.concurrency} clients, "
                f"{args.max_tokens} tokens, `{args.osd_args}`; `{result['command']}`)",
                ["\n".join(rows)] + (["Errors seen:\n" + "\n".join(notes)] if notes else []), Path(path),
                args.markdown)


def report_scale(result: dict, out: str, markdown: str | None) -> None:
    path = write_result(result, out)
    gb = lambda b: f"{b / 1e9:.2f}" if b else "-"
    rows = ["| replicas x threads | aggregate tok/s | TTFT p50 / p95 s | errors | learner samples/s | bytes/sample | "
            "publish -> swap s, per replica (-> all, from the call) | replica peak RSS GB | learner peak RSS GB | Ray start s / idle RSS GB |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["records"]:
        pub = r.get("publish") or {}
        rows.append(f"| {r['replicas']} x {r.get('threads', 1)} | {r['aggregate_tokens_per_s']:.1f} | {r['ttft_p50_s'] or 0:.2f} / "
                    f"{r['ttft_p95_s'] or 0:.2f} | {r['errors']} | {r.get('learner_samples_per_s') or 0:.1f} | "
                    f"{r.get('bytes_per_sample') or 0:.0f} | "
                    f"{', '.join(f'{x:.2f}' for x in pub.get('publish_to_swap_seconds') or [] if x is not None)} "
                    f"({pub.get('all_replicas_seconds') or 0:.2f}) | "
                    f"{', '.join(gb(b) for b in r['replica_peak_rss_bytes'])} | "
                    f"{gb((r.get('learner') or {}).get('peak_rss_bytes'))} | "
                    + (f"{r['ray_start_seconds']:.1f} / {gb(r['ray_idle_rss_bytes'])} |" if r["replicas"] else "no Ray |"))
    blocks = ["\n".join(rows), f"Greedy answers identical to the first arm's: {result['identity_vs_first_arm']}"]
    p = result.get("projection")
    if p:
        blocks.append(f"Projection (a model from the {p['from_replicas']}-replica arm's measured inputs, not a "
                      f"measurement): {p['samples_per_s_per_replica']:.1f} samples/s per replica x "
                      f"{p['bytes_per_sample']:.0f} B = {p['network_bytes_per_s_per_replica'] / 1e3:.1f} kB/s per "
                      f"replica to the learner; the learner takes a sample in {p['learner_ingest_seconds_per_sample'] * 1e3:.2f} ms, "
                      f"so one learner ingests the samples of ~{p['replicas_one_learner_ingests'] or 0:.0f} such "
                      f"replicas; each published version ships {(p['publish_payload_bytes'] or 0) / 1e6:.1f} MB once "
                      "to the object store.")
    c = result["config"]
    emit_report("Scale-out on Ray (osd bench scale)",
                f"`osd bench scale` ({c['requests']} requests, {c['concurrency']} clients, {c['max_tokens']} tokens, "
                f"threads per replica {c['threads']}, `{c['osd_args']}`, learning {c['learning']})", blocks,
                Path(path), markdown)
