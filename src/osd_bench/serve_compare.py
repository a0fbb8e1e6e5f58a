"""`osd bench serve-vs`: osd serve against llama.cpp's llama-server under load, side by side in one run.

Each server runs alone on the machine, one after the other, on the same GGUF with the same threads: llama-server
(`-np N --cont-batching`, built once from the llama.cpp that llama-cpp-python vendors, bench/llama_server.py: the
`llama-server` arm with the wheel's portable AVX2 flags, `llama-server-native` built for this CPU as llama.cpp builds by
default, AVX-512 included where the CPU has it) and `osd serve` in the arms asked (speculative without learning, with
learning, target-only k = 0: the greedy reference every osd answer must equal). Every arm gets the same prompts in
the same order: level c takes its own slice of the prompt list (no prompt is repeated across levels, so the n-gram
lookup cannot replay an earlier level's answer), after one warm-up request that is not counted. Streaming chat
completions, greedy, a fixed max_tokens.
Per server and level: aggregate output tokens/s over the level's wall time, per-request decode tokens/s (after the
first token), TTFT and end-to-end p50/p95, errors, the server's peak RSS (VmHWM from /proc) and, for osd, the mean k,
acceptance and tokens per step from the responses' `osd` fields and the server's scheduler counters.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from osd_bench.llama_server import ServerStartError, build_features, ensure_llama_server, llama_server_command, running
from osd_bench.serve_load import Sample, _client, _request_body, one_request, percentile
from osd_bench.speed import bench_prompts
from osd.data import load_records

OSD_ARMS = {  # arm -> extra `osd serve` flags
    "osd": ["--no-learn"],
    "osd-learning": ["--learn"],
    "osd-target-only": ["--no-learn", "--k", "0"],
}
# arm -> environment: the `-avx2` arms are their plain arms with osd's kernel forced onto its AVX2 path (what AVX2-only
# CPUs run; bitwise the same results), to set beside llama-server's portable build on a machine that has AVX-512
OSD_ARM_ENV = {f"{arm}-avx2": {"OSD_Q4_ISA": "avx2"} for arm in ("osd", "osd-target-only")}
OSD_ARMS.update({arm: OSD_ARMS[arm.removesuffix("-avx2")] for arm in OSD_ARM_ENV})
LLAMA_ARMS = {"llama-server": "portable", "llama-server-native": "native"}  # arm -> its build (llama_server.py)
REFERENCE_ARM = "osd-target-only"


@dataclass
class CompareConfig:
    gguf: Path
    prompts: list[str]
    levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    per_level: int = 16
    max_tokens: int = 64
    threads: int = 2
    port: int = 8791
    n_ctx: int = 2048  # per sequence
    arms: tuple[str, ...] = ("llama-server", "osd", "osd-learning", "osd-target-only")
    osd_args: tuple[str, ...] = ("--lookup",)
    logs: Path = Path("runs/bench-serve-vs")
    long_prompt: str | None = None  # a ~1,000-token prompt whose prefill speed each server gets measured on


def interleaved_prompts(n: int, domains=("code", "gsm8k", "spider", "chat"), split: str = "test") -> list[str]:
    """n test prompts taking the domains in turn (code, gsm8k, spider, chat, code, ...)."""
    per = -(-n // len(domains))
    by_domain = [[r["prompt"] for r in bench_prompts(per, split, (d,))] for d in domains]
    return [by_domain[i % len(domains)][i // len(domains)] for i in range(n)]


def long_prompt(chars: int) -> str:
    """Code test prompts from the end of the split, joined up to `chars` characters, with a closing ask."""
    parts, total = [], 0
    for record in reversed(load_records("code", split="test")):
        parts.append(record["prompt"])
        total += len(record["prompt"])
        if total >= chars:
            break
    return "Summarise these tasks in one line each:\n\n" + "\n\n".join(parts)


def level_prompts(prompts: list[str], levels, per_level: int) -> dict[int, list[str]]:
    """Each level its own consecutive slice (after prompts[0], the warm-up); InvalidArgument-free: the caller checks
    that enough prompts exist."""
    out, at = {}, 1
    for c in levels:
        out[c] = prompts[at : at + per_level]
        at += per_level
    return out


def peak_rss_bytes(pid: int) -> int | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def scheduler_counters(client: httpx.AsyncClient) -> dict[str, float]:
    """osd's scheduler counters from /metrics ({} for llama-server)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get("/metrics")
        if r.status_code != 200 or "osd_schedule_steps" not in r.text:
            return {}
    except httpx.HTTPError:
        return {}
    return {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples
            if s.name.startswith("osd_schedule_") and s.name.endswith("_total")}


async def learner_steps(client: httpx.AsyncClient) -> int | None:
    """The server's learner's optimizer steps so far (GET /v1/osd/learner); None where it has none (404, llama-server)."""
    try:
        r = await client.get("/v1/osd/learner")
        return int(r.json()["optimizer_steps"]) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def run_level(client, model: str, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[list, float]:
    todo = list(enumerate(prompts))
    samples: list[tuple[int, Sample]] = []

    async def client_loop():
        while todo:
            i, prompt = todo.pop(0)
            for attempt in range(3):  # a keep-alive connection the server closed before answering: ask again
                sample = await one_request(client, *_request_body(model, prompt, max_tokens, True))
                if sample.ok or not (sample.error or "").startswith("RemoteProtocolError") or sample.text:
                    break
            sample.retries = attempt
            samples.append((i, sample))

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return sorted(samples, key=lambda x: x[0]), time.perf_counter() - start


def summarise_level(server: str, learning: bool, concurrency: int, samples: list[Sample], wall: float,
                    peak_rss: int | None, sched: dict) -> dict:
    ok = [s for s in samples if s.ok]
    tokens = sum(s.completion_tokens for s in ok)
    ttft = [s.ttft for s in ok if s.ttft is not None]
    e2e = [s.seconds for s in ok]
    decode = [1.0 / s.tpot for s in ok if s.tpot]
    proposed = sum(s.osd.get("proposed") or 0 for s in ok)
    accepted = sum(s.osd.get("accepted") or 0 for s in ok)
    steps = sum(s.osd.get("steps") or 0 for s in ok)
    d = lambda name: sched.get(f"osd_schedule_{name}_total")
    return {"server": server, "learning": learning, "concurrency": concurrency, "requests": len(samples),
            "errors": len(samples) - len(ok), "error_examples": [s.error for s in samples if not s.ok][:3],
            "retried": sum(getattr(s, "retries", 0) for s in samples),
            "wall_seconds": wall, "completion_tokens": tokens,
            "aggregate_tokens_per_s": tokens / wall if wall else None,
            "decode_tokens_per_s_p50": percentile(decode, 50),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "e2e_p50_s": percentile(e2e, 50), "e2e_p95_s": percentile(e2e, 95),
            "peak_rss_bytes": peak_rss,
            "acceptance_rate": accepted / proposed if proposed else None,
            "tokens_per_step": tokens / steps if steps else None,
            "mean_k": d("proposed") / d("sequence_steps") if sched and d("sequence_steps") else None,
            "rows_per_step": d("rows") / d("steps") if sched and d("steps") else None,
            "draft_versions": sorted({s.osd.get("draft_version") for s in ok if s.osd}, key=str),
            # each request in the level's prompt order: what a tail (TTFT p95) is made of
            "per_request": [{"ok": s.ok, "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                             "ttft_s": s.ttft, "e2e_s": s.seconds} for s in samples]}


async def measure_server(server: str, learning: bool, url: str, pid: int, config: CompareConfig):
    """-> (level records, {level: [answer text per prompt]}, the prefill record or None)."""
    by_level = level_prompts(config.prompts, config.levels, config.per_level)
    records, texts = [], {}
    async with _client(url, None, 1800.0, max(config.levels) + 2) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        warm = await one_request(client, *_request_body(model, config.prompts[0], config.max_tokens, True))
        if not warm.ok:
            raise RuntimeError(f"{server}: the warm-up request failed: {warm.error}")
        for c in config.levels:
            before, steps_before = await scheduler_counters(client), await learner_steps(client)
            samples, wall = await run_level(client, model, by_level[c], config.max_tokens, c)
            after, steps_after = await scheduler_counters(client), await learner_steps(client)
            sched = {k: after[k] - before.get(k, 0.0) for k in after}
            record = summarise_level(server, learning, c, [s for _, s in samples], wall, peak_rss_bytes(pid), sched)
            # how much learning the level's cost bought (an update in flight at its end counts in the next level)
            record["learner_optimizer_steps"] = None if steps_before is None or steps_after is None \
                else steps_after - steps_before
            records.append(record)
            texts[c] = [s.text if s.ok else None for _, s in samples]
            print(f"  {server:16s} c={c:<3d} {record['aggregate_tokens_per_s']:.1f} tok/s, TTFT p50 "
                  f"{record['ttft_p50_s'] or 0:.2f} s p95 {record['ttft_p95_s'] or 0:.2f} s, errors {record['errors']}",
                  flush=True)
        prefill = await measure_prefill(client, model, server, learning, config.long_prompt) if config.long_prompt else None
    return records, texts, prefill


async def measure_prefill(client, model: str, server: str, learning: bool, prompt: str, repeats: int = 3) -> dict:
    """Prompt tokens per second on one long prompt, alone on the server: prompt tokens / time to the first token of a
    1-token answer (best of `repeats`; each server's own prompt cache is defeated by a distinct first word)."""
    best = None
    for i in range(repeats):
        sample = await one_request(client, *_request_body(model, f"({i}) {prompt}", 1, True))
        if not sample.ok or not sample.ttft:
            return {"server": server, "learning": learning, "error": sample.error}
        if best is None or sample.ttft < best.ttft:
            best = sample
    rate = best.prompt_tokens / best.ttft if best.prompt_tokens else None
    print(f"  {server:16s} prefill: {best.prompt_tokens} prompt tokens, {best.ttft:.2f} s to the first token = "
          f"{rate or 0:.0f} tokens/s", flush=True)
    return {"server": server, "learning": learning, "prompt_tokens": best.prompt_tokens,
            "ttft_s": best.ttft, "prompt_tokens_per_s": rate}


def osd_command(arm: str, config: CompareConfig) -> list[str]:
    osd = shutil.which("osd", path=str(Path(sys.executable).parent)) or "osd"
    return [osd, "serve", "--port", str(config.port), "--threads", str(config.threads),
            "--max-batch", str(max(config.levels)), "--n-ctx", str(config.n_ctx),
            "--checkpoint-dir", str(config.logs / f"ckpt-{arm}"), *config.osd_args, *OSD_ARMS[arm]]


def run_compare(config: CompareConfig) -> dict:
    needed = 1 + config.per_level * len(config.levels)
    if len(config.prompts) < needed:
        raise ValueError(f"{needed} prompts needed (1 warm-up + {config.per_level} per level), {len(config.prompts)} given")
    url = f"http://127.0.0.1:{config.port}"
    records, texts, prefill, failed = [], {}, [], []
    for arm in config.arms:
        env = None
        if arm in LLAMA_ARMS:
            binary = ensure_llama_server(build=LLAMA_ARMS[arm])
            command = llama_server_command(binary, config.gguf, config.port, config.threads, max(config.levels),
                                           config.n_ctx)
            env = dict(os.environ, LD_LIBRARY_PATH=f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}")
        else:
            shutil.rmtree(config.logs / f"ckpt-{arm}", ignore_errors=True)  # every learning arm starts fresh
            command = osd_command(arm, config)
            env = dict(os.environ, **OSD_ARM_ENV[arm]) if arm in OSD_ARM_ENV else None
        print(f"[serve-vs] {arm}: {' '.join(command)}{''.join(f' ({k}={v})' for k, v in OSD_ARM_ENV.get(arm, {}).items())}",
              flush=True)
        log = config.logs / f"{arm}.log"
        try:
            with running(command, url, log, env) as process:
                arm_records, texts[arm], arm_prefill = asyncio.run(
                    measure_server(arm, arm == "osd-learning", url, process.pid, config))
        except ServerStartError as e:  # this arm did not run; the others still do, and the report says why
            failed.append({"server": arm, "command": " ".join(command), "error": str(e), "log": str(log),
                           "log_tail": log_tail(log)})
            print(f"[serve-vs] {arm} did not start: {e}; its log: {log}", flush=True)
            continue
        build = {"llama_build": LLAMA_ARMS[arm], "llama_features": build_features(binary)} if arm in LLAMA_ARMS else \
            {"osd_env": OSD_ARM_ENV[arm]} if arm in OSD_ARM_ENV else {}
        for r in arm_records:
            r["server"], r["command"] = arm, " ".join(command)
            r.update(build)
        records += arm_records
        prefill += [arm_prefill] if arm_prefill else []
    return {"records": records, "prefill": prefill, "identity": identity(texts, config.levels), "failed_arms": failed}


def log_tail(path: Path, lines: int = 5) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def identity(texts: dict, levels) -> dict:
    """Per osd arm: requests whose greedy answer equals osd target-only's on the same prompt, per level."""
    if REFERENCE_ARM not in texts:
        return {}
    out = {}
    for arm, by_level in texts.items():
        if arm == REFERENCE_ARM or arm in LLAMA_ARMS:
            continue
        out[arm] = {str(c): {"same": sum(a is not None and a == b for a, b in zip(by_level[c], texts[REFERENCE_ARM][c])),
                             "of": len(by_level[c])} for c in levels}
    return out
