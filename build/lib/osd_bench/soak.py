"""`osd bench soak`: N concurrent clients drive a live `osd serve` for M minutes with a mix of valid and
invalid requests, and check every answer.

The request mix (`build_cases`): valid chat and text completions, streaming and not, greedy and sampled,
with and without stop strings; clients that disconnect mid-stream; and invalid requests, each with the
status and error code the server must answer (malformed JSON, NaN, wrong types, a stop of the wrong
type, an oversized body, prompts and max_tokens past the context, lone surrogates, NUL, an unknown role,
an unknown model, a wrong API key). Clients take cases from one shared shuffled cycle, so every case is
sent at least once whatever the duration (`min_requests`).

Checks: every valid request answered in full (a stream ends with a finish chunk and [DONE]); every invalid
one answered with its status and an OpenAI-style error body {"error": {message, type, param, code}} with
the expected code; every valid greedy answer equal to the target-only answer for the same request
(`references`, computed once per distinct greedy request before the load starts); the server's
osd_http_requests_total grew by exactly the responses the clients saw (every status counted).
Figures: latency p50/p95 of valid requests, RSS and threads of the server process (start, after a warm-up
round, vs end), learner updates published (from /metrics).
Limitations: RSS and threads are read from /proc (Linux); an in-process server shares its process with
the clients, so its RSS includes theirs. The metrics cross-check assumes no other client uses the server.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from osd_bench.serve_load import percentile

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass(frozen=True)
class GreedyKey:
    """A greedy request as the target-only reference sees it."""

    chat: bool
    prompt: str
    max_tokens: int
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Case:
    kind: str
    path: str
    body: bytes
    expect: int  # HTTP status the server must answer
    code: str | None = None  # error code it must give (invalid requests)
    stream: bool = False
    disconnect: bool = False  # close the connection after the first text chunk
    api_key: str | None = None  # None: the soak's key; otherwise this one (wrong_key)
    greedy: GreedyKey | None = None  # compared with the target-only answer
    error_type: str = "invalid_request_error"  # the error body's `type` (invalid requests)
    param: object = ...  # the error body's `param` (a field name, or None); ... = not checked

    @property
    def valid(self) -> bool:
        return self.expect == 200


@dataclass
class Outcome:
    kind: str
    expect: int
    status: int | None = None  # None: no HTTP response (transport error)
    ok: bool = False  # the right status with a complete answer / a well-formed error body
    seconds: float = 0.0
    text: str = ""
    greedy: GreedyKey | None = None
    path: str = ""
    error: str | None = None


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


def valid_cases(model: str, prompts: list[str], max_tokens: int) -> list[Case]:
    cases = []
    for p in prompts:
        user = [{"role": "user", "content": p}]
        chat = {"model": model, "messages": user, "max_tokens": max_tokens, "temperature": 0}
        text = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0}
        stop = [p[-2:]] if len(p) >= 2 else ["\n\n"]  # a stop string the text may well contain
        cases += [
            Case("chat", CHAT, _json(chat), 200, greedy=GreedyKey(True, p, max_tokens)),
            Case("chat_stream", CHAT, _json(chat | {"stream": True}), 200, stream=True,
                 greedy=GreedyKey(True, p, max_tokens)),
            Case("completion", COMPLETIONS, _json(text), 200, greedy=GreedyKey(False, p, max_tokens)),
            Case("completion_stream_stop", COMPLETIONS, _json(text | {"stream": True, "stop": stop}), 200,
                 stream=True, greedy=GreedyKey(False, p, max_tokens, tuple(stop))),
            Case("chat_sampled_stream", CHAT, _json(chat | {"temperature": 0.8, "top_p": 0.9, "seed": 7,
                                                            "stream": True}), 200, stream=True),
            Case("disconnect_mid_stream", CHAT, _json(chat | {"stream": True}), 200, stream=True, disconnect=True),
        ]
    return cases


def invalid_cases(model: str, prompt: str, context: int, max_body_bytes: int, api_key: str | None) -> list[Case]:
    """One request per kind of bad input, with the status and code osd's error table gives it."""
    user = [{"role": "user", "content": prompt}]
    chat = {"model": model, "messages": user, "max_tokens": 4}
    raw = lambda text: ('{"model": %s, "messages": [{"role": "user", "content": "%s"}], "max_tokens": 4}'
                        % (json.dumps(model), text)).encode()
    cases = [
        Case("malformed_json", CHAT, b'{"model": "x", "messages": [', 400, "invalid_json", param=None),
        Case("nan_in_json", COMPLETIONS, b'{"prompt": "a", "temperature": NaN}', 400, "invalid_json", param=None),
        Case("wrong_type_messages", CHAT, _json({"model": model, "messages": prompt}), 400, "invalid_type",
             param="messages"),
        Case("wrong_type_max_tokens", CHAT, _json(chat | {"max_tokens": "four"}), 400, "invalid_type",
             param="max_tokens"),
        Case("stop_wrong_type", CHAT, _json(chat | {"stop": 5}), 400, "invalid_type", param="stop"),
        Case("oversized_body", CHAT, _json(chat | {"messages": [{"role": "user", "content": "a" * max_body_bytes}]}),
             413, "request_too_large", param=None),
        Case("prompt_past_context", COMPLETIONS, _json({"model": model, "prompt": [0] * (context + 1), "max_tokens": 1}),
             400, "context_length_exceeded", param=None),
        Case("max_tokens_past_context", CHAT, _json(chat | {"max_tokens": context}), 400, "context_length_exceeded",
             param=None),
        Case("lone_surrogate", CHAT, raw("ab\\ud800c"), 400, param="messages[0].content"),
        Case("nul_character", CHAT, raw("a\\u0000b"), 400, param="messages[0].content"),
        Case("unknown_role", CHAT, _json(chat | {"messages": [{"role": "wizard", "content": prompt}]}), 400,
             param="messages[0].role"),
        Case("unknown_model", CHAT, _json(chat | {"model": model + "-nope"}), 404, "model_not_found", param="model"),
    ]
    if api_key:
        cases.append(Case("wrong_key", CHAT, _json(chat), 401, "invalid_api_key", api_key=api_key + "-wrong",
                          param=None))
    return cases


def build_cases(model: str, prompts: list[str], max_tokens: int, context: int, max_body_bytes: int,
                api_key: str | None) -> list[Case]:
    return valid_cases(model, prompts, max_tokens) + invalid_cases(model, prompts[0], context, max_body_bytes, api_key)


def error_body_ok(body, code: str | None, error_type: str | None = None, param: object = ...) -> bool:
    """An OpenAI-style error: {"error": {message (non-empty), type, param, code}} with the expected code, and the
    expected type and param where given (param ... = any)."""
    error = body.get("error") if isinstance(body, dict) else None
    return (isinstance(error, dict) and set(error) == ERROR_KEYS and isinstance(error["message"], str)
            and bool(error["message"]) and isinstance(error["type"], str) and error["code"] == code
            and (error_type is None or error["type"] == error_type) and (param is ... or error["param"] == param))


def _text_of(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send(client: httpx.AsyncClient, case: Case) -> Outcome:
    out, start = Outcome(case.kind, case.expect, greedy=case.greedy, path=case.path), time.perf_counter()
    headers = {"Content-Type": "application/json"}
    if case.api_key is not None:
        headers["Authorization"] = f"Bearer {case.api_key}"
    try:
        async with client.stream("POST", case.path, content=case.body, headers=headers) as r:
            out.status = r.status_code
            if r.status_code != 200 or not case.stream:
                body = await r.aread()
                out.ok = _check_plain(out, case, body)
            else:
                out.ok = await _read_stream(out, case, r)
    except (httpx.HTTPError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
    except (ValueError, LookupError, TypeError) as e:  # a malformed answer fails this request, not the soak
        out.ok, out.error = False, f"malformed answer: {type(e).__name__}: {e}"
    out.seconds = time.perf_counter() - start
    return out


def _check_plain(out: Outcome, case: Case, raw: bytes) -> bool:
    try:
        body = json.loads(raw)
    except ValueError:
        out.error = f"not JSON: {raw[:200]!r}"
        return False
    if out.status != case.expect:
        out.error = f"expected {case.expect}, got {out.status}: {raw[:200]!r}"
        return False
    if not case.valid:
        return error_body_ok(body, case.code, case.error_type, case.param) or _fail(
            out, f"not the expected error body (code {case.code}, type {case.error_type}, param {case.param!r}): "
                 f"{raw[:200]!r}")
    choice = body["choices"][0]
    out.text = choice["message"]["content"] if case.path == CHAT else choice["text"]
    return choice.get("finish_reason") in ("stop", "length") or _fail(out, f"finish_reason {choice.get('finish_reason')}")


async def _read_stream(out: Outcome, case: Case, r: httpx.Response) -> bool:
    finished, done = False, False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return _fail(out, f"error event: {chunk['error']}")
        if chunk.get("choices"):
            out.text += _text_of(chunk)
            finished = finished or chunk["choices"][0].get("finish_reason") is not None
            if case.disconnect and out.text:
                return True  # leaving the `with` closes the connection mid-stream
    if case.disconnect:
        return True  # the answer was shorter than one text chunk: nothing to cut
    return (finished and done) or _fail(out, f"stream ended early (finish chunk {finished}, [DONE] {done})")


def _fail(out: Outcome, why: str) -> bool:
    out.error = why
    return False


def process_stats(pid: int) -> dict:
    """RSS (bytes) and thread count of a process, from /proc (Linux); {} when it cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
        return {"rss_bytes": int(fields["VmRSS"].split()[0]) * 1024, "threads": int(fields["Threads"])}
    except (OSError, KeyError, ValueError):
        return {}


async def scrape(client: httpx.AsyncClient) -> dict:
    """/metrics -> {(sample name, sorted label pairs): value}; {} when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get("/metrics")
        r.raise_for_status()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(r.text) for s in family.samples}
    except (httpx.HTTPError, ValueError):
        return {}


def responses_counted(samples: dict) -> Counter:
    """osd_http_requests_total per (endpoint, status), /metrics itself left out."""
    out = Counter()
    for (name, labels), value in samples.items():
        labels = dict(labels)
        if name == "osd_http_requests_total" and labels.get("endpoint") != "/metrics":
            out[(labels["endpoint"], int(labels["status"]))] += int(value)
    return out


@dataclass
class SoakConfig:
    clients: int = 8  # concurrent clients
    seconds: float = 600.0  # how long clients keep sending (requests in flight then finish)
    min_requests: int = 0  # send at least this many (0 = one of each case), whatever the duration
    seed: int = 0
    timeout: float = 900.0  # per request
    sample_every: float = 5.0  # seconds between RSS samples
    pause: float = 0.0  # seconds each client waits between its requests (0 = saturate the server)
    warmup_rounds: int = 1  # then each client sends every valid kind this many times at once, not counted either:
    #   the server's working set at this concurrency (connections, threads) before RSS start
    warmup_updates: int = 1  # ... and more such rounds until the learner has published this many updates (its
    #   autograd working set is then in RSS start; a server without a learner stops after warmup_rounds)
    warmup_max_rounds: int = 50  # give up waiting for the learner after this many rounds (reported, not fatal)


@dataclass
class _Shared:
    order: list[Case]
    deadline: float
    min_requests: int
    pause: float = 0.0
    sent: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    def next_case(self) -> Case | None:
        if time.monotonic() >= self.deadline and self.sent >= self.min_requests:
            return None
        case = self.order[self.sent % len(self.order)]
        self.sent += 1
        return case


async def run_soak_async(url: str, cases: list[Case], config: SoakConfig, references: dict[GreedyKey, str],
                         api_key: str | None = None, pid: int | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    order = cases[:]
    random.Random(config.seed).shuffle(order)
    make = lambda: httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=config.timeout)
    async with make() as control:
        warmup = [await send(control, c) for c in _one_per_kind(cases) if c.valid]  # lazy allocations, not counted
        serial = process_stats(pid) if pid else {}
        rounds, before = await _warm_up(make, control, [c for c in _one_per_kind(cases) if c.valid], config, warmup)
        stats_start = process_stats(pid) if pid else {}
        shared = _Shared(order, time.monotonic() + config.seconds, config.min_requests or len(cases), config.pause)
        rss = [stats_start.get("rss_bytes")]
        start = time.perf_counter()
        sampler = asyncio.create_task(_sample_rss(pid, config.sample_every, rss))
        await asyncio.gather(*(_client_loop(make, shared) for _ in range(config.clients)))
        wall = time.perf_counter() - start
        sampler.cancel()
        after, stats_end = await scrape(control), process_stats(pid) if pid else {}
    summary = summarise(shared.outcomes, references)
    got = Counter((o.path, o.status) for o in shared.outcomes if o.status is not None)
    counted = responses_counted(after) - responses_counted(before)
    return {"config": {"url": url, "clients": config.clients, "seconds": config.seconds, "seed": config.seed,
                       "pause": config.pause,
                       "cases": len(cases), "kinds": sorted({c.kind for c in cases})},
            "wall_seconds": wall, "warmup_ok": all(o.ok for o in warmup), "warmup_rounds": rounds,
            "warmup_requests": len(warmup), **summary,
            "metrics_match_responses": counted == got if before and after else None,
            "metrics_counted": {f"{e} {s}": n for (e, s), n in sorted(counted.items())},
            "server": _server_figures(stats_start, stats_end, [r for r in rss if r], pid, config.sample_every,
                                      serial.get("rss_bytes")),
            "learner": _learner_figures(before, after)}


async def _warm_up(make, control: httpx.AsyncClient, valid: list[Case], config: SoakConfig,
                   outcomes: list) -> tuple[int, dict]:
    """Concurrent rounds of every valid kind: config.warmup_rounds, then on until the learner has published
    config.warmup_updates updates (at most config.warmup_max_rounds). -> (rounds sent, /metrics after them)."""
    rounds, samples = 0, await scrape(control)
    published = lambda: samples.get(("osd_learner_updates_published_total", ()))  # None: no learner
    while rounds < config.warmup_rounds or (published() is not None and published() < config.warmup_updates
                                            and rounds < config.warmup_max_rounds):
        warm = _Shared(valid, 0.0, len(valid) * config.clients)
        await asyncio.gather(*(_client_loop(make, warm) for _ in range(config.clients)))
        outcomes += warm.outcomes
        rounds, samples = rounds + 1, await scrape(control)
    return rounds, samples


def _one_per_kind(cases: list[Case]) -> list[Case]:
    return list({c.kind: c for c in cases}.values())


async def _client_loop(make, shared: _Shared) -> None:
    async with make() as client:  # one connection pool per client, as separate users would have
        while (case := shared.next_case()) is not None:
            shared.outcomes.append(await send(client, case))
            if shared.pause:
                await asyncio.sleep(shared.pause)


async def _sample_rss(pid: int | None, every: float, out: list) -> None:
    while pid:
        await asyncio.sleep(every)
        out.append(process_stats(pid).get("rss_bytes"))


def greedy_mismatches(outcomes: list[Outcome], references: dict[GreedyKey, str]) -> tuple[int, list[dict]]:
    """-> (greedy answers checked, the ones that differ from the target-only reference)."""
    checked = [o for o in outcomes if o.ok and o.greedy is not None and o.greedy in references]
    bad = [{"kind": o.kind, "prompt": o.greedy.prompt, "got": o.text, "target_only": references[o.greedy]}
           for o in checked if o.text != references[o.greedy]]
    return len(checked), bad


def summarise(outcomes: list[Outcome], references: dict[GreedyKey, str]) -> dict:
    kinds = {}
    for o in outcomes:
        k = kinds.setdefault(o.kind, {"expected": o.expect, "sent": 0, "ok": 0, "got": Counter(), "examples": []})
        k["sent"] += 1
        k["ok"] += o.ok
        k["got"][str(o.status) if o.status is not None else "no response"] += 1
        if not o.ok and len(k["examples"]) < 3:
            k["examples"].append(o.error)
    valid = [o for o in outcomes if o.expect == 200 and o.kind != "disconnect_mid_stream"]
    invalid = [o for o in outcomes if o.expect != 200]
    checked, mismatches = greedy_mismatches(outcomes, references)
    seconds = [o.seconds for o in valid if o.ok]
    return {"requests": len(outcomes), "answered": sum(o.status is not None for o in outcomes),
            "valid": {"sent": len(valid), "ok": sum(o.ok for o in valid),
                      "latency_p50": percentile(seconds, 50), "latency_p95": percentile(seconds, 95)},
            "invalid": {"sent": len(invalid), "ok": sum(o.ok for o in invalid)},
            "disconnects": {"sent": sum(o.kind == "disconnect_mid_stream" for o in outcomes),
                            "ok": sum(o.ok for o in outcomes if o.kind == "disconnect_mid_stream")},
            "greedy": {"checked": checked, "identical": checked - len(mismatches), "mismatches": mismatches[:5]},
            "kinds": {name: k | {"got": dict(k["got"])} for name, k in sorted(kinds.items())}}


def _server_figures(start: dict, end: dict, rss: list[int], pid: int | None, every: float,
                    serial_warmup: int | None = None) -> dict:
    """RSS after the warm-up, at mid-soak (the middle sample) and at the end: growth over the whole soak includes
    buffers filling up (the learner's replay buffer); growth over the second half tells a plateau from a leak.
    serial_warmup: RSS after the one-request-at-a-time part of the warm-up (before the concurrent round), with the
    growth from there too, so what the concurrent warm-up took is in the record."""
    r0, r1 = start.get("rss_bytes"), end.get("rss_bytes")
    mid = rss[len(rss) // 2] if rss else None
    growth = lambda a, b: 100 * (b - a) / a if a and b else None
    half = len(rss) // 2
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
    first, second = median(rss[:half]), median(rss[half:])  # a leak raises the level; a learner update in flight
    #   at one end (its restore point, gradients: transient) does not move the median of a half
    return {"pid": pid, "rss_after_serial_warmup_bytes": serial_warmup,
            "rss_median_first_half_bytes": first, "rss_median_second_half_bytes": second,
            "rss_median_growth_pct": growth(first, second),
            "rss_growth_from_serial_warmup_pct": growth(serial_warmup, r1),
            "rss_start_bytes": r0, "rss_mid_bytes": mid, "rss_end_bytes": r1,
            "rss_peak_bytes": max(rss + [r1 or 0]) or None, "rss_growth_pct": growth(r0, r1),
            "rss_growth_second_half_pct": growth(mid, r1),
            "threads_start": start.get("threads"), "threads_end": end.get("threads"),
            "rss_series_mib": {"every_seconds": every, "mib": [round(r / 2**20, 1) for r in rss]}}  # plateau or leak


def _learner_figures(before: dict, after: dict) -> dict:
    value = lambda samples, name: None if samples.get((name, ())) is None else int(samples[(name, ())])
    out = {}
    for stat, name in (("updates_published", "osd_learner_updates_published_total"),
                       ("updates_rejected", "osd_learner_updates_rejected_total"),
                       ("optimizer_steps", "osd_learner_optimizer_steps_total"), ("version", "osd_learner_version")):
        start, end = value(before, name), value(after, name)
        out |= {f"{stat}_start": start, f"{stat}_end": end}
        if stat != "version":
            out[stat] = end - start if None not in (start, end) else None
    for part in ("optimizer", "versions", "buffers"):  # what the learner holds (learn/memory.py), start vs end
        name = f"osd_learner_memory_{part}_bytes"
        out |= {f"memory_{part}_bytes_start": value(before, name), f"memory_{part}_bytes_end": value(after, name)}
    return out


def targets(result: dict, max_rss_growth_pct: float = 5.0) -> dict:
    """The issue's targets, each True/False (None: not measured)."""
    growth, updates = result["server"]["rss_growth_pct"], result["learner"]["updates_published"]
    return {"all_valid_answered": result["valid"]["ok"] == result["valid"]["sent"] > 0,
            "all_invalid_rejected_right": result["invalid"]["ok"] == result["invalid"]["sent"] > 0,
            "disconnects_survived": result["disconnects"]["ok"] == result["disconnects"]["sent"],
            "greedy_identical_to_target_only": None if not result["greedy"]["checked"]
            else result["greedy"]["identical"] == result["greedy"]["checked"],
            "every_status_counted": result["metrics_match_responses"],
            "rss_growth_under_5pct": None if growth is None else growth < max_rss_growth_pct,
            "learner_updates_published": None if updates is None else updates > 0}


def run_soak(*args, **kwargs) -> dict:
    result = asyncio.run(run_soak_async(*args, **kwargs))
    result["targets"] = targets(result)
    return result

