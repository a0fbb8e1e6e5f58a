"""`osd bench serve`: a streaming load generator against a live server (loopback).

For each concurrency level, the same prompts are sent by that many concurrent clients (after one
warm-up request that is not counted). Per request: time to first token (TTFT, send -> first text
chunk, queueing included) and time per output token (TPOT, first -> last text chunk over the
remaining tokens). Per level: output tokens/s over the level's wall time, requests/s, TTFT and TPOT
p50/p95, and the speculative figures the server reported in each response's `osd` field.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import httpx

KEEPALIVE_EXPIRY = 2.0  # seconds an idle connection is reused: below the servers' keep-alive (_client)


@dataclass
class Sample:
    ok: bool = False
    ttft: float | None = None
    tpot: float | None = None
    seconds: float = 0.0
    completion_tokens: int = 0
    osd: dict = field(default_factory=dict)
    error: str | None = None
    text: str = ""  # the streamed answer
    prompt_tokens: int = 0  # from the usage chunk


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; q in [0, 100]."""
    if not values:
        return None
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _request_body(model: str, prompt: str, max_tokens: int, chat: bool) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", body | {"prompt": prompt}


def _text_of(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def one_request(client: httpx.AsyncClient, path: str, body: dict) -> Sample:
    sample, start, first, last, chunks = Sample(), time.perf_counter(), None, None, 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                sample.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return sample
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    sample.error = chunk["error"].get("message")
                    return sample
                if chunk.get("choices") and (piece := _text_of(chunk)):
                    now = time.perf_counter()
                    first, last, chunks = first or now, now, chunks + 1
                    sample.text += piece
                sample.osd = chunk.get("osd") or sample.osd
                if chunk.get("usage"):
                    sample.completion_tokens = chunk["usage"]["completion_tokens"]
                    sample.prompt_tokens = chunk["usage"].get("prompt_tokens") or 0
    except httpx.HTTPError as e:
        sample.error = f"{type(e).__name__}: {e}"
        return sample
    sample.seconds = time.perf_counter() - start
    sample.completion_tokens = sample.completion_tokens or chunks
    if first is not None:
        sample.ttft = first - start
        if sample.completion_tokens > 1:
            sample.tpot = (last - first) / (sample.completion_tokens - 1)
    sample.ok = True
    return sample


async def run_level(client: httpx.AsyncClient, model: str, prompts: list[str], max_tokens: int, chat: bool,
                    concurrency: int) -> dict:
    todo: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        todo.put_nowait(p)
    samples: list[Sample] = []

    async def client_loop():
        while not todo.empty():
            samples.append(await one_request(client, *_request_body(model, todo.get_nowait(), max_tokens, chat)))

    before = await server_counters(client)
    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    level = summarise(samples, wall, concurrency)
    routing = routing_share(before, await server_counters(client), wall)
    return {**level, "routing": routing} if routing else level


# a routing server's own seconds (route/metrics.py), read from /metrics around each level
ROUTE_SECONDS = {"osd_route_seconds_total": "route_seconds", "osd_route_score_seconds_total": "score_seconds"}


async def server_counters(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's routing seconds and drafts' bytes from /metrics; empty when it does not route (or /metrics is
    closed to this client)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get("/metrics")
        r.raise_for_status()
    except httpx.HTTPError:
        return {}
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name in ROUTE_SECONDS:
                out[ROUTE_SECONDS[sample.name]] = sample.value
            elif sample.name == "osd_drafts_bytes":
                out["bytes_" + sample.labels["part"]] = sample.value
    return out


def routing_share(before: dict, after: dict, wall: float) -> dict | None:
    """Seconds the server spent routing and scoring drafts during a level, and their share of its wall time (issue
    18: <= 2% at concurrency 1). Scoring runs after a request ends, so the last request's may fall after the level."""
    if not all(k in before and k in after for k in ROUTE_SECONDS.values()):
        return None
    spent = {k: after[k] - before[k] for k in ROUTE_SECONDS.values()}
    return {**spent, "share": (spent["route_seconds"] + spent["score_seconds"]) / wall if wall else None}


def drafts_memory(counters: dict) -> dict | None:
    """A routing server's drafts' bytes and their ratio to one draft (issue 18: five drafts <= 1.5x one)."""
    if "bytes_total" not in counters or not counters.get("bytes_one_draft"):
        return None
    return {"total_bytes": counters["bytes_total"], "one_draft_bytes": counters["bytes_one_draft"],
            "ratio": counters["bytes_total"] / counters["bytes_one_draft"]}


def summarise(samples: list[Sample], wall: float, concurrency: int) -> dict:
    ok = [s for s in samples if s.ok]
    tokens = sum(s.completion_tokens for s in ok)
    ttft, tpot = [s.ttft for s in ok if s.ttft is not None], [s.tpot for s in ok if s.tpot is not None]
    proposed = sum(s.osd.get("proposed") or 0 for s in ok)
    accepted = sum(s.osd.get("accepted") or 0 for s in ok)
    steps = sum(s.osd.get("steps") or 0 for s in ok)
    return {"concurrency": concurrency, "requests": len(samples), "errors": len(samples) - len(ok),
            "error_examples": [s.error for s in samples if not s.ok][:3], "wall_seconds": wall,
            "completion_tokens": tokens, "tokens_per_second": tokens / wall if wall else None,
            "requests_per_second": len(ok) / wall if wall else None,
            "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
            "tpot_p50": percentile(tpot, 50), "tpot_p95": percentile(tpot, 95),
            "acceptance_rate": accepted / proposed if proposed else None,
            "tokens_per_step": tokens / steps if steps else None,
            "draft_versions": sorted({s.osd.get("draft_version") for s in ok if s.osd}, key=str)}


def _client(url: str, api_key: str | None, timeout: float, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # idle connections dropped after 2 s, before any server closes them (uvicorn's default keep-alive is 5 s, httpx's
    # expiry too: a request sent on a connection closed at that instant failed with a read error)
    return httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout,
                             limits=httpx.Limits(max_connections=connections, keepalive_expiry=KEEPALIVE_EXPIRY))


async def _model_and_warm_up(client: httpx.AsyncClient, model: str | None, prompt: str, max_tokens: int,
                             chat: bool) -> tuple[str, Sample]:
    """The model id (the server's first, unless given) and one warm-up request, not counted."""
    if model is None:
        r = await client.get("/v1/models")
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
    return model, await one_request(client, *_request_body(model, prompt, max_tokens, chat))


async def run_load_async(url: str, prompts: list[str], max_tokens: int = 64, concurrency=(1, 2, 4), chat: bool = True,
                         api_key: str | None = None, model: str | None = None, timeout: float = 600.0) -> dict:
    async with _client(url, api_key, timeout, max(concurrency) + 1) as client:
        model, warm = await _model_and_warm_up(client, model, prompts[0], max_tokens, chat)
        levels = [await run_level(client, model, prompts, max_tokens, chat, c) for c in concurrency]
        memory = drafts_memory(await server_counters(client))
    return {"config": {"url": url, "model": model, "prompts": len(prompts), "max_tokens": max_tokens, "chat": chat,
                       "concurrency": list(concurrency), "temperature": 0},
            "warmup_ok": warm.ok, "levels": levels, **({"drafts_memory": memory} if memory else {})}


def run_load(*args, **kwargs) -> dict:
    return asyncio.run(run_load_async(*args, **kwargs))


# --- what online learning costs serving: paired rounds on one server -------------------------------------------
# Two servers measured minutes apart differ by more than learning costs (this machine drifts by tens of percent),
# so the learning server itself alternates: rounds with its learner running and rounds with it paused
# (POST /v1/osd/learner), in the order on/off, off/on, ... Each round pair gives one ratio of p50 TPOT; their
# geometric mean and its 95% interval (Student t over the rounds' log ratios) are the cost. An update in flight
# parks at its next chunk of work when paused and goes on in the next learning round, so little learning work falls
# outside the rounds: what does (the pause request's wait for that chunk) is recorded as the paused round's
# learner_before.switch_seconds, summed in pause_wait_seconds.

T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086]  # Student t 97.5% quantiles, df 1..20 (beyond: 1.96 + small)


def t975(df: int) -> float:
    return T975[df - 1] if df <= len(T975) else 1.96 + 2.4 / df


def paired_ratio(on: list[float], off: list[float]) -> dict:
    """Geometric mean of on/off over paired rounds, with a 95% t interval (pure; on and off are per-round values)."""
    logs = [math.log(a / b) for a, b in zip(on, off) if a and b]
    n = len(logs)
    if n == 0:
        return {"rounds": 0, "ratio": None, "ci95": None, "on_slower_rounds": 0}
    mean = sum(logs) / n
    if n == 1:
        ci = None
    else:
        sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
        half = t975(n - 1) * sd / math.sqrt(n)
        ci = [math.exp(mean - half), math.exp(mean + half)]
    return {"rounds": n, "ratio": math.exp(mean), "ci95": ci, "on_slower_rounds": sum(x > 0 for x in logs)}


async def _set_learning(client: httpx.AsyncClient, learning: bool) -> dict:
    r = await client.post("/v1/osd/learner", json={"paused": not learning})
    if r.status_code != 200:
        raise RuntimeError(f"cannot {'resume' if learning else 'pause'} the server's learner: HTTP {r.status_code} "
                           f"{r.text[:200]} (pairing needs a server started with --learn)")
    return r.json()


async def run_paired_learning_async(url: str, prompts: list[str], rounds: int, max_tokens: int = 64,
                                    concurrency: int = 1, chat: bool = True, api_key: str | None = None,
                                    model: str | None = None, timeout: float = 600.0, progress=None) -> dict:
    async with _client(url, api_key, timeout, concurrency + 1) as client:
        model, warm = await _model_and_warm_up(client, model, prompts[0], max_tokens, chat)
        per_round = []
        try:
            for i in range(rounds):
                order = (True, False) if i % 2 == 0 else (False, True)
                row = {"round": i}
                for learning in order:
                    asked = time.perf_counter()
                    state = await _set_learning(client, learning)  # pausing waits for an update in flight to park
                    state["switch_seconds"] = time.perf_counter() - asked
                    level = await run_level(client, model, prompts, max_tokens, chat, concurrency)
                    learner = await client.get("/v1/osd/learner")
                    row["learning" if learning else "paused"] = level | {
                        "learner_before": state, "learner_after": learner.json()}
                per_round.append(row)
                if progress:
                    progress(row)
        finally:
            await _set_learning(client, True)  # leave the server learning, as it started
    tpot = paired_ratio([r["learning"]["tpot_p50"] for r in per_round], [r["paused"]["tpot_p50"] for r in per_round])
    # aggregate output tokens/s: what learning costs a server under load (TPOT alone misses the time a step waits)
    throughput = paired_ratio([r["learning"]["tokens_per_second"] for r in per_round],
                              [r["paused"]["tokens_per_second"] for r in per_round])
    steps = sum(optimizer_steps(r["learning"]) for r in per_round)
    steps_paused = sum(optimizer_steps(r["paused"]) for r in per_round)
    uncounted = sum(r["paused"]["learner_before"]["switch_seconds"] for r in per_round)
    return {"config": {"url": url, "model": model, "prompts": len(prompts), "max_tokens": max_tokens, "chat": chat,
                       "concurrency": concurrency, "rounds": rounds, "temperature": 0, "paired_learning": True},
            "warmup_ok": warm.ok, "rounds": per_round, "tpot_p50_ratio": tpot,
            "tokens_per_second_ratio": throughput,
            "optimizer_steps_learning": steps, "optimizer_steps_paused": steps_paused,
            "pause_wait_seconds": uncounted,
            "learning_wall_seconds": sum(r["learning"]["wall_seconds"] for r in per_round)}


def optimizer_steps(arm: dict) -> int:
    """The learner's optimizer steps during one arm of a round (run_paired_learning's rows)."""
    return arm["learner_after"]["optimizer_steps"] - arm["learner_before"]["optimizer_steps"]


def run_paired_learning(*args, **kwargs) -> dict:
    return asyncio.run(run_paired_learning_async(*args, **kwargs))
