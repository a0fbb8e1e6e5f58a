"""ASGI middleware: request body size limit (413); answering escaped errors and counting every response."""
from __future__ import annotations

from osd.serve.errors import BodyTooLarge, error_response


class BodyLimit:
    """Refuses bodies over max_bytes: at once from Content-Length, else while the body is read."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = BodyTooLarge(f"request body exceeds the limit of {self.max_bytes} bytes")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(too_large)(scope, receive, send)
        seen, started = 0, False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise too_large
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await error_response(too_large)(scope, receive, send)


class CountRequests:
    """Outermost: answers any exception that escaped the app (the error table's status, 500 for the
    unexpected) and counts every HTTP response as (endpoint, status); unknown paths count as "other".

    Answering here, rather than in Starlette's ServerErrorMiddleware, keeps 500s counted and keeps the
    client's connection open. Limitation: an exception after a response has started (mid-stream) cannot
    be answered; it propagates (the response's status was counted when it started).
    """

    def __init__(self, app, metrics, endpoints: set[str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.count(endpoint, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:
            if started:
                raise
            await error_response(exc)(scope, receive, counting_send)
