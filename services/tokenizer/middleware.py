"""ASGI middleware around every route of the HTTP API: the body-size limit, the API key,
request metrics and trace spans. A refusal is OpenAI's error body (`adapters.error_body`),
like every other failure (docs/api.md, "Authentication" and "Errors")."""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from observability.metrics import TokenizerMetrics
from observability.tracing import Tracing
from services.tokenizer.adapters import RequestError, error_body

OPEN_PATHS = ("/health", "/healthz", "/health_generate", "/metrics")
"""Probes and scrapers carry no API key."""


async def _reject(scope: Scope, receive: Receive, send: Send, err: RequestError) -> None:
    await JSONResponse(error_body(err), err.status)(scope, receive, send)


class BodySizeLimit:
    """413 for a body over `max_bytes`: at once when Content-Length says so, else as soon
    as the bytes read pass the limit (chunked uploads)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> RequestError:
        return RequestError(
            f"the request body exceeds {self.max_bytes} bytes", code="request_too_large", status=413
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await _reject(scope, receive, send, self._too_large())
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)


class RequestMetrics:
    """Counts every answered request by route (not raw path: no unbounded label values)."""

    def __init__(self, app: ASGIApp, metrics: TokenizerMetrics, routes: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.routes else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


class TraceRequests:
    """One server span per API request (not probes or scrapes): the root of the request's
    trace, or a child of the client's `traceparent`. Handlers run inside it, so what they
    send to the worker carries its context."""

    def __init__(self, app: ASGIApp, tracing: Tracing, routes: frozenset[str]):
        self.app = app
        self.tracing = tracing
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        with self.tracing.server_span(f"{scope['method']} {route}", headers) as span:
            span.set_attribute("http.route", route)

            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            await self.app(scope, receive, traced_send)


class ApiKeyAuth:
    """`Authorization: Bearer <api_key>` on every path but the probes'."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                err = RequestError("invalid or missing API key", code="invalid_api_key", status=401)
                return await _reject(scope, receive, send, err)
        await self.app(scope, receive, send)
