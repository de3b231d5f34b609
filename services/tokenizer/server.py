"""The HTTP face of radixserve (docs/api.md): `create_app` puts together the routes
(`routes`), the middleware (`middleware`) and the error handlers below; `EdgeProtocol`
is the connection handling uvicorn runs it with.

Every failure leaves as OpenAI's error body (`errors.error_body`), whatever raised it:
a bad request, a dead peer, an unknown route, or a bug (then without its traceback). A
client that leaves is no failure of the server: it is logged as such, not as a 500.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import h11
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from observability.metrics import TokenizerMetrics
from observability.tracing import setup_tracing
from services.settings import Settings
from services.tokenizer import openapi
from services.tokenizer.errors import RequestError, error_body, validation_error_body
from services.tokenizer.manager import running_manager
from services.tokenizer.middleware import (
    ApiKeyAuth,
    ApiKeys,
    BodyReadTimeout,
    BodySizeLimit,
    RequestMetrics,
    TraceRequests,
)
from services.tokenizer.routes import router
from services.tokenizer.serving_base import AppState
from services.tokenizer.worker_metrics_proxy import WorkerMetricsProxy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MAX_REQUEST_BODY_BYTES = 16 * 2**20
"""Larger bodies get a 413 before they are read: a 128k-token prompt is well under 1 MB."""


def create_app(
    settings: Settings,
    tokenizer: PreTrainedTokenizerBase | None,
    max_body_bytes: int = MAX_REQUEST_BODY_BYTES,
) -> FastAPI:
    """The ASGI app; its TokenizerManager (and so its sockets) lives as long as the app runs.
    Raises `ApiKeyFileError` for a `--api-key-file` it cannot use."""
    keys = ApiKeys.from_settings(settings)
    registry = CollectorRegistry()
    metrics = TokenizerMetrics(registry, settings.model_id)
    tracing = setup_tracing("tokenizer")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with running_manager(settings, tokenizer, metrics, tracing) as manager:
                app.state.radixserve = AppState(
                    settings=settings,
                    tokenizer=tokenizer,
                    manager=manager,
                    registry=registry,
                    worker_metrics=WorkerMetricsProxy(
                        settings.host, settings.worker_metrics_port, metrics
                    ),
                    tracing=tracing,
                    started=int(time.time()),
                )
                yield
        finally:
            if tracing is not None:
                tracing.shutdown()

    app = FastAPI(
        title="radixserve",
        lifespan=lifespan,
        docs_url=None if settings.disable_openapi else "/docs",
        redoc_url=None,
        openapi_url=None if settings.disable_openapi else "/openapi.json",
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.openapi = lambda: openapi.document(app, settings)  # type: ignore[method-assign]
    app.include_router(router)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(BodyReadTimeout, timeout=settings.http_body_timeout)
    app.add_middleware(ApiKeyAuth, keys=keys)
    routes = frozenset(route.path for route in router.routes if isinstance(route, Route))
    app.add_middleware(RequestMetrics, metrics=metrics, routes=routes)
    if tracing is not None:
        app.add_middleware(TraceRequests, tracing=tracing, routes=routes)
    return app


# ----- error handlers: every error as OpenAI's body; a bug is logged here, shown to nobody --


BODY_LEFT_UNREAD = (408, 413)
"""Statuses answered before the whole body was read: the connection cannot carry another
request, so it is closed."""


async def _request_error(request: Request, err: RequestError) -> JSONResponse:
    headers = {"connection": "close"} if err.status in BODY_LEFT_UNREAD else None
    return JSONResponse(error_body(err), err.status, headers=headers)


async def _client_disconnect(request: Request, exc: ClientDisconnect) -> Response:
    """The client left while its body was read: nobody reads the answer (499, nginx's
    "client closed request"), and it is the client's doing, not a server error."""
    logger.info("client left before sending its whole request (%s)", request.url.path)
    return Response(status_code=499)


async def _validation_error(
    request: Request, exc: ValidationError | RequestValidationError
) -> JSONResponse:
    return JSONResponse(validation_error_body(exc), 400)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(
        error_body(RequestError(str(exc.detail), code=code, status=exc.status_code)),
        exc.status_code,
    )


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path)
    err = RequestError(
        "internal server error; see the server log", code="internal_error", status=500
    )
    return JSONResponse(error_body(err), 500)


EXCEPTION_HANDLERS: dict[
    int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]
] = {
    RequestError: _request_error,
    ValidationError: _validation_error,
    RequestValidationError: _validation_error,
    ClientDisconnect: _client_disconnect,
    StarletteHTTPException: _http_error,
    Exception: _internal_error,
}


# ----- connections ----------------------------------------------------------------------


class EdgeProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with what a server facing the open network needs and
    uvicorn lacks: a deadline on the request headers (a client that trickles them would
    hold its connection forever: slowloris) and a cap on open connections, past which a
    request is answered 503 with OpenAI's error body and its connection closed.

    Configure it with `configured`; the body's own timeout is `BodyReadTimeout`'s, and idle
    keep-alive connections are uvicorn's (`timeout_keep_alive`)."""

    header_timeout: float = 10.0
    max_connections: int = 1024

    @classmethod
    def configured(cls, settings: Settings) -> type[EdgeProtocol]:
        """The protocol class for `uvicorn.run(http=...)`, with the settings' limits."""
        limits = {
            "header_timeout": settings.http_header_timeout,
            "max_connections": settings.max_connections,
        }
        return type(cls.__name__, (cls,), limits)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.header_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)  # type: ignore[arg-type]
        if len(self.connections) > self.max_connections:
            self.app = _too_many_connections(self.max_connections)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self.header_deadline is None and self._awaiting_headers():
            self._arm_header_deadline()  # the next request of a kept-alive connection
        super().data_received(data)
        if not self._awaiting_headers():
            self._disarm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _arm_header_deadline(self) -> None:
        self.header_deadline = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_late(self) -> None:
        self.header_deadline = None
        if self._awaiting_headers() and not self.transport.is_closing():
            logger.debug("closed a connection whose headers took over %g s", self.header_timeout)
            self.transport.close()


def _too_many_connections(limit: int) -> JSONResponse:
    err = RequestError(
        f"the server has {limit} connections open (--max-connections); retry later",
        code="service_unavailable",
        status=503,
    )
    return JSONResponse(error_body(err), err.status, headers={"connection": "close"})
