"""HTTP errors: ONE table from exception type to (HTTP status, OpenAI error type, code).

Every failure leaves the server as an OpenAI-style body {"error": {message, type, param, code}}.
Library errors (osd.errors) keep their own messages; the serving layer adds only the errors that
exist because of HTTP (auth, body size, JSON, routing).
"""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from osd.errors import ContextTooLong, DraftNotFound, InvalidArgument

log = logging.getLogger("osd.serve")


class ServeError(Exception):
    """An error raised by the serving layer; `param` names the request field when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class BadParam(InvalidArgument):
    """A library InvalidArgument tied to the request field that caused it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class BadJSON(ServeError):
    pass


class UnknownModel(ServeError):
    pass


class NoLearner(ServeError):
    pass


class Unauthorized(ServeError):
    pass


class BodyTooLarge(ServeError):
    pass


class ShuttingDown(ServeError):
    pass


class ReplicaFailed(ServeError):
    """A serving replica of a cluster (cluster/pool.py) died during the request, or none could take it."""


# exception type -> (HTTP status, OpenAI error type, code). Looked up along the exception's MRO,
# so a subclass listed here wins over its base (ContextTooLong before InvalidArgument).
ERROR_TABLE: dict[type, tuple[int, str, str | None]] = {
    ContextTooLong: (400, "invalid_request_error", "context_length_exceeded"),
    InvalidArgument: (400, "invalid_request_error", None),
    BadJSON: (400, "invalid_request_error", "invalid_json"),
    ValidationError: (400, "invalid_request_error", "invalid_type"),  # as OpenAI: 400, not FastAPI's 422
    UnknownModel: (404, "invalid_request_error", "model_not_found"),
    DraftNotFound: (404, "invalid_request_error", "draft_not_found"),
    NoLearner: (404, "invalid_request_error", "learner_not_running"),
    Unauthorized: (401, "invalid_request_error", "invalid_api_key"),
    BodyTooLarge: (413, "invalid_request_error", "request_too_large"),
    ShuttingDown: (503, "server_error", "shutting_down"),
    ReplicaFailed: (503, "server_error", "replica_failed"),
}
INTERNAL = (500, "server_error", None)


def classify(exc: BaseException) -> tuple[int, str, str | None]:
    for cls in type(exc).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return INTERNAL


def error_body(exc: BaseException) -> tuple[int, dict]:
    """-> (HTTP status, OpenAI error body) for any exception."""
    status, kind, code = classify(exc)
    param = getattr(exc, "param", None)
    if isinstance(exc, ValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = str(first["loc"][0]) if first.get("loc") else None  # the request field (not pydantic's union branch)
        code = "missing_required_parameter" if first.get("type") == "missing" else code
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
    elif status == 500:
        message = "internal server error"
    else:
        message = str(exc)
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: BaseException) -> Response:
    """The error as an HTTP response. The body is ASCII JSON, so a message quoting client text that holds
    lone surrogates still encodes (a UTF-8 body would fail on them and turn a 400 into a 500)."""
    status, body = error_body(exc)
    if status == 500:
        log.error("unexpected error", exc_info=exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")


def sse_error(exc: BaseException) -> str:
    """An error after a stream has started: one SSE event (the OpenAI client raises on it)."""
    return f"data: {json.dumps(error_body(exc)[1])}\n\n"


def install(app: FastAPI) -> None:
    """Route the table's exceptions through it; routing errors (404/405) keep their status. Any other
    exception is answered by middleware.CountRequests (a 500, counted), not by Starlette's last resort."""

    async def handle(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    async def handle_http(request: Request, exc: HTTPException) -> JSONResponse:
        body = {"error": {"message": str(exc.detail), "type": "invalid_request_error", "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    for cls in ERROR_TABLE:
        app.add_exception_handler(cls, handle)
    app.add_exception_handler(HTTPException, handle_http)
