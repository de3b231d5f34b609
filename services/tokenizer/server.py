"""The HTTP face of radixserve (docs/api.md): `create_app` puts together the routes
(`routes`), the middleware (`middleware`) and the error handlers below.

Every failure leaves as OpenAI's error body (`adapters.error_body`), whatever raised it:
a bad request, a dead peer, an unknown route, or a bug (then without its traceback).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from observability.metrics import TokenizerMetrics
from observability.tracing import setup_tracing
from services.settings import Settings
from services.tokenizer.adapters import RequestError, error_body, validation_error_body
from services.tokenizer.manager import running_manager
from services.tokenizer.middleware import ApiKeyAuth, BodySizeLimit, RequestMetrics, TraceRequests
from services.tokenizer.routes import router
from services.tokenizer.serving import AppState, served_model
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
    """The ASGI app; its TokenizerManager (and so its sockets) lives as long as the app runs."""
    registry = CollectorRegistry()
    metrics = TokenizerMetrics(registry, served_model(settings))
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
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.include_router(router)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyAuth, api_key=settings.api_key)
    routes = frozenset(route.path for route in router.routes if isinstance(route, Route))
    app.add_middleware(RequestMetrics, metrics=metrics, routes=routes)
    if tracing is not None:
        app.add_middleware(TraceRequests, tracing=tracing, routes=routes)
    return app


# ----- error handlers: every error as OpenAI's body; a bug is logged here, shown to nobody --


async def _request_error(request: Request, err: RequestError) -> JSONResponse:
    return JSONResponse(error_body(err), err.status)


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
    StarletteHTTPException: _http_error,
    Exception: _internal_error,
}
