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
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Sample:
    ok: bool = False
    ttft: float | None = None
    tpot: float | None = None
    seconds: float = 0.0
    completion_tokens: int = 0
    osd: dict = field(default_factory=dict)
    error: str | None = None


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
                if chunk.get("choices") and _text_of(chunk):
                    now = time.perf_counter()
                    first, last, chunks = first or now, now, chunks + 1
                sample.osd = chunk.get("osd") or sample.osd
                if chunk.get("usage"):
                    sample.completion_tokens = chunk["usage"]["completion_tokens"]
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

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return summarise(samples, time.perf_counter() - start, concurrency)


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


async def run_load_async(url: str, prompts: list[str], max_tokens: int = 64, concurrency=(1, 2, 4), chat: bool = True,
                         api_key: str | None = None, model: str | None = None, timeout: float = 600.0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(concurrency) + 1)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout, limits=limits) as client:
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        warm = await one_request(client, *_request_body(model, prompts[0], max_tokens, chat))  # not counted
        levels = [await run_level(client, model, prompts, max_tokens, chat, c) for c in concurrency]
    return {"config": {"url": url, "model": model, "prompts": len(prompts), "max_tokens": max_tokens, "chat": chat,
                       "concurrency": list(concurrency), "temperature": 0},
            "warmup_ok": warm.ok, "levels": levels}


def run_load(*args, **kwargs) -> dict:
    return asyncio.run(run_load_async(*args, **kwargs))
