"""OpenAI-compatible app factory. Routes translate HTTP <-> library; the engine works on one worker thread.

Endpoints: POST /v1/chat/completions, POST /v1/completions (stream or not), GET /v1/models (the target; its
drafts and their versions in the entry's `osd` field),
GET /health, GET /metrics (Prometheus text, serve/prom.py; behind the API key with
ServeSettings.metrics_require_key), GET / POST /v1/osd/learner (online learning's state; {"paused": true|false}
pauses or resumes it: an update in flight parks at its next chunk of work, and finishes after the resume; 404
learner_not_running without --learn). Every completion carries an `osd` extension field
with its own speculative decoding figures (accepted, proposed, alpha, tokens_per_step, draft, ...). A request
may pin the draft that serves it with its own `osd` field, {"osd": {"draft": "<name>"}} (unknown: 404).

Requests run together on the engine's scheduler (up to its capacity; the rest queue in arrival order, at most
ServeSettings.max_queue of them: past it 503 queue_full with Retry-After). A request without max_tokens gets what the
context has left after its prompt, at most ServeSettings.default_max_tokens. usage.prompt_tokens_details.cached_tokens
counts the prompt tokens prefix reuse served from a slot's cache. logprobs (chat: logprobs + top_logprobs; completions:
logprobs = N) are the target's raw log-softmax at each emitted position, as vLLM's default (serve/logprobs.py); a
stream carries each chunk's tokens' figures with it. Sampling extensions as in vLLM: top_k, min_p, stop_token_ids,
ignore_eos.
Limitations: n = 1; no penalties, logit_bias, tools or structured output: refused by name (schemas.UNSUPPORTED).
A request whose streaming client disconnects is aborted at its next text delta; its speculative
counters are then not recorded.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from osd.engine import GenerationResult
from osd.serve import errors
from osd.serve.chat_template import with_chat_template
from osd.serve.errors import BadJSON, NoLearner, Unauthorized
from osd.serve.middleware import BodyLimit, CountRequests
from osd.serve.prom import CONTENT_TYPE, ServeMetrics, learning_effect, learning_summary
from osd.serve.schemas import ChatCompletionRequest, CompletionRequest, LearnerControl
from osd.serve.settings import ServeSettings
from osd.serve.stats_line import StatsLine, read_engine
from osd.serve.translate import (Shapes, chat_prompt, check_common, completion_prompt, osd_stats, pinned_draft,
                                 sampling_from)
from osd.serve.worker import Job, Worker

log = logging.getLogger("osd.serve")
ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/v1/osd/learner"}


class Lifecycle:
    """Starts and stops the worker, the optional learner and routing feedback, once each (idempotent)."""

    def __init__(self, worker: Worker, learner=None, routing=None):
        self.worker, self.learner, self.routing = worker, learner, routing
        self._lock, self._started, self._stopped = threading.Lock(), False, False

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        self.worker.start()
        if self.learner is not None:
            self.learner.start()
        if self.routing is not None:
            self.routing.start()

    def stop(self) -> None:
        """Stop the worker (cancelling a generation whose connection uvicorn has already closed at
        shutdown), then the learner (it writes its checkpoint)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self.worker.stop(timeout=120, cancel_running=True)
        if self.routing is not None:
            self.routing.stop()
        if self.learner is not None:  # also when it was started by its builder (attach_learner)
            self.learner.stop()


def learning_extra(engine):
    """The stats line's "learning" figure: the serving draft's acceptance and tokens per step, newest version against
    the first (serve/prom.py learning_effect), while a learner runs."""
    def extra() -> dict:
        summary = learning_summary(learning_effect(engine.metrics.counters()))
        return {"learning": summary} if summary else {}  # nothing drafted yet: no figure

    return extra


def create_app(engine, tokenizer, model_name: str, learner=None, settings: ServeSettings | None = None,
               routing=None, worker_thread: bool = True, pool=None) -> FastAPI:
    """routing: several drafts and their router (route/system.py), or None (the engine's one proposer).
    worker_thread=False: the caller runs the model work itself (`app.state.worker.run_here()`, serve/cli.py).
    pool: serving replicas on Ray (cluster/pool.py ReplicaPool) instead of a local engine (engine None then)."""
    settings = settings or ServeSettings()
    model_name = settings.model_name or model_name
    tokenizer = with_chat_template(tokenizer, settings.chat_template)  # prompts only; the engine keeps its own
    metrics = ServeMetrics()
    if pool is None:
        worker = Worker(engine, own_thread=worker_thread, max_queue=settings.max_queue)
        window = engine.context_window
        metrics.attach(engine.metrics, learner, lambda: worker.depth, engine=engine)
        drafts = lambda: _drafts(engine, routing)
    else:  # replicas on Ray: they bring their own metrics (relabelled) and drafts
        worker = pool
        window = getattr(pool, "context_window", 0)
        metrics.attach_cluster(pool)
        drafts = pool.drafts
    if routing is not None:
        from osd.route.metrics import RouteCollector

        metrics.registry.register(RouteCollector(routing))
    lifecycle = Lifecycle(worker, learner, routing)
    # the periodic "running | queued | tok/s | acceptance | ..." line (serve/stats_line.py); not over replicas yet
    stats_line = StatsLine(lambda: read_engine(engine, worker, learner, drafts), settings.stats_interval,
                           extras=(learning_extra(engine),) if learner is not None else ()) if pool is None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        lifecycle.start()
        if stats_line is not None:
            stats_line.start()
        try:
            yield
        finally:
            if stats_line is not None:
                stats_line.stop()
            await asyncio.to_thread(lifecycle.stop)

    app = FastAPI(title="osd", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan)
    app.state.lifecycle, app.state.settings, app.state.metrics, app.state.worker = lifecycle, settings, metrics, worker
    app.state.stats_line = stats_line  # more figures join it through stats_line.extras
    errors.install(app)
    auth = [Depends(_api_key_check(settings.api_key))]

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        arrived = time.perf_counter()
        req = await _parse(request, ChatCompletionRequest)
        check_common(req, model_name)
        max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
        prompt = chat_prompt(req, tokenizer)
        sampling = sampling_from(req, settings, max_tokens, room=_room(window, prompt))
        draft = pinned_draft(req, drafts())
        job = worker.submit(prompt, sampling, stream=bool(req.stream), draft=draft)
        return await _respond(job, req, Shapes(chat=True, model=model_name, tokenizer=tokenizer), metrics, arrived)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        arrived = time.perf_counter()
        req = await _parse(request, CompletionRequest)
        check_common(req, model_name)
        prompt = completion_prompt(req, tokenizer)
        sampling = sampling_from(req, settings, req.max_tokens, room=_room(window, prompt))
        draft = pinned_draft(req, drafts())
        job = worker.submit(prompt, sampling, stream=bool(req.stream), draft=draft)
        return await _respond(job, req, Shapes(chat=False, model=model_name, tokenizer=tokenizer), metrics, arrived)

    @app.get("/v1/models", dependencies=auth)
    async def models():
        """The target, with its drafts in the entry's `osd` extension (only the target is a model a client can
        ask for by `model`; a request pins a draft with its own `osd.draft`)."""
        listed = [{"id": name, "version": version} for name, version in sorted(drafts().items())]
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "osd",
                                            "osd": {"drafts": listed}}]}

    @app.get("/v1/osd/learner", dependencies=auth)
    async def learner_state():
        return _learner_state(learner)

    @app.post("/v1/osd/learner", dependencies=auth)
    async def learner_control(request: Request):
        control = await _parse(request, LearnerControl)
        if control.paused:
            if not await asyncio.to_thread(_learning(learner).pause):  # still paused: the update in flight parks when it can
                log.warning("learner paused, but the update in flight did not reach a chunk boundary in time")
        else:
            _learning(learner).unpause()
        return _learner_state(learner)

    @app.get("/health")
    async def health():
        ok = worker.alive
        body = {"status": "ok" if ok else "unavailable", "model": model_name, "queue_depth": worker.depth}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", dependencies=auth if settings.metrics_require_key else [])
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(CountRequests, metrics=metrics, endpoints=ENDPOINTS)  # outermost: counts 413s and 500s too
    return app


def _room(window: int, prompt: list[int]) -> int | None:
    """Tokens the context has left after the prompt (None: the target's window is unknown)."""
    return window - len(prompt) if window else None


def _learning(learner):
    """The server's learner; 404 learner_not_running when it has none."""
    if learner is None:
        raise NoLearner("this server does not learn online (start it with --learn)")
    return learner


def _learner_state(learner) -> dict:
    stats = _learning(learner).stats()
    return {"paused": bool(learner.paused), "training": bool(stats.get("training")), "parked": bool(stats.get("parked")),
            **{key: stats.get(key) for key in ("version", "updates_published", "optimizer_steps", "train_seconds")}}


def _drafts(engine, routing) -> dict[str, int]:
    """Draft name -> published version: the routed drafts, or the engine's one proposer (none without one)."""
    if routing is not None:
        return routing.versions()
    proposer = engine.proposer
    if proposer is None:
        return {}
    versioned = getattr(proposer, "versioned", None)  # several sources (propose/chain.py): the one that learns
    name = proposer.sources[versioned].name if versioned is not None else proposer.name.rsplit("+", 1)[-1]
    return {name: proposer.version}


def _api_key_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise Unauthorized("invalid or missing API key (send 'Authorization: Bearer <key>')")

    return check


async def _parse(request: Request, model_cls):
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_not_json)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadJSON(f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise BadJSON("request body must be a JSON object")
    return model_cls.model_validate(data)


def _not_json(name: str):
    """NaN and Infinity: Python's json accepts them, JSON (and OpenAI) does not."""
    raise ValueError(f"{name} is not a JSON value")


async def _next(job: Job):
    try:
        return await job.next()
    except asyncio.CancelledError:
        job.cancelled = True
        raise


async def _respond(job: Job, req, shapes: Shapes, metrics: ServeMetrics, arrived: float):
    kind, payload = await _next(job)
    if kind == "error":
        raise payload
    if not req.stream:
        _observe(metrics, job, payload, arrived)
        return JSONResponse(shapes.response(payload))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    events = _stream(job, (kind, payload), shapes, metrics, arrived, include_usage)
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream(job: Job, first, shapes: Shapes, metrics: ServeMetrics, arrived: float, include_usage: bool):
    """SSE: (role chunk for chat), text chunks, a finish chunk with `osd` stats, (usage), [DONE]. With logprobs, each
    text chunk carries its tokens' (serve/worker.py) and the finish chunk the rest."""
    asked, sent = job.sampling.logprobs is not None, 0
    try:
        if shapes.chat:
            yield _sse(shapes.chunk(text="", role=True))
        kind, payload = first
        while kind == "text":
            entries = (job.chunk_logprobs.popleft() if job.chunk_logprobs else []) if asked else None
            sent += len(entries or [])
            yield _sse(shapes.chunk(text=payload, logprobs=entries))
            kind, payload = await job.next()
        if kind == "error":
            yield errors.sse_error(payload)
        else:
            _observe(metrics, job, payload, arrived)
            rest = payload.logprobs[sent:] if asked and payload.logprobs is not None else None
            yield _sse(shapes.chunk(finish_reason=payload.finish_reason, osd=osd_stats(payload), logprobs=rest))
            if include_usage:
                yield _sse(shapes.usage_chunk(payload))
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = True  # the client is gone (or we are done): stop generating for it


def _observe(metrics: ServeMetrics, job: Job, result: GenerationResult, arrived: float) -> None:
    ttft = job.first_text_at - arrived if job.first_text_at is not None else None
    metrics.observe(time.perf_counter() - arrived, ttft, len(result.prompt_ids), len(result.token_ids), result.seconds)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
