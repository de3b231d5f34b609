"""The HTTP face of radixserve: OpenAI's chat and completions, SGLang's native `/generate`,
health and control endpoints.

Every failure leaves as OpenAI's error body (`adapters.error_body`), whatever raised it:
a bad request, a dead peer, an unknown route, or a bug (then without its traceback).
Chat and completions share one flow (`_serve_openai`); they differ only in how the prompt
is built and how the answer is shaped (`_OpenAIEndpoint`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.sampling.sampling_params import MAX_SEED, SamplingParams
from observability.metrics import TokenizerMetrics
from observability.tracing import Tracing, maybe_span, setup_tracing
from services.protocol import TokenizedGenerateReqInput
from services.settings import Settings
from services.tokenizer.adapters import (
    RequestError,
    apply_chat_template,
    check_model,
    error_body,
    to_sampling_params,
    tokenize_prompts,
    validation_error_body,
)
from services.tokenizer.manager import ReqOutput, TokenizerManager, running_manager, unavailable
from services.tokenizer.openai_api import ChatCompletionRequest, CompletionRequest, GenerateRequest
from services.tokenizer.responses import (
    SSE_DONE,
    ChatCompletionStream,
    ChoiceOutput,
    CompletionStream,
    ResponseHeader,
    TokenLogprob,
    chat_completion_response,
    completion_response,
    generate_response,
    model_list,
    sse_event,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MAX_REQUEST_BODY_BYTES = 16 * 2**20
"""Larger bodies get a 413 before they are read: a 128k-token prompt is well under 1 MB."""
HEALTH_GENERATE_TIMEOUT_S = 20.0
MAX_SEQUENCES_PER_REQUEST = 1024
"""Prompts × n of one HTTP request. Past it the request is refused (400) before it is
tokenized or fanned out, so one body cannot become millions of requests (OpenAI caps n at
128)."""
OPEN_PATHS = ("/health", "/healthz", "/health_generate", "/metrics")
"""Probes and scrapers carry no API key."""

RequestT = TypeVar("RequestT", bound=BaseModel)


class AbortRequestInput(BaseModel):
    """SGLang's `/abort_request`: one rid (an OpenAI response id aborts all its choices)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    rid: str = ""
    abort_all: bool = False


# ----- middleware ---------------------------------------------------------------------------


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


# ----- request plumbing ---------------------------------------------------------------------


async def parse_body(request: Request, model: type[RequestT]) -> RequestT:
    """The JSON body as `model`; a pydantic ValidationError (malformed JSON included) is
    answered by the app's handler."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise RequestError(
            f"Content-Type must be application/json, got {content_type or 'none'!r}",
            code="unsupported_media_type",
            status=415,
        )
    return model.model_validate_json(await request.body())


def check_fan_out(num_sequences: int, param: str) -> None:
    if num_sequences > MAX_SEQUENCES_PER_REQUEST:
        raise RequestError(
            f"this request asks for {num_sequences} sequences (prompts × n); at most {MAX_SEQUENCES_PER_REQUEST} "
            "are served per request",
            param=param,
        )


def fan_out(
    rid_prefix: str,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    n: int,
    stream: bool,
    extra_key: str | None = None,
    priority: int = 0,
) -> list[TokenizedGenerateReqInput]:
    """`n` requests per prompt, in OpenAI's choice order (sample j of prompt i is choice
    i*n + j). Each sample of a seeded request gets its own seed, so the `n` samples differ
    and the whole answer is still reproducible."""
    reqs = []
    for input_ids, sp in zip(prompts, params):
        for j in range(n):
            seed = None if sp.seed is None else (sp.seed + j) % (MAX_SEED + 1)
            reqs.append(
                TokenizedGenerateReqInput(
                    rid=f"{rid_prefix}-{len(reqs)}",
                    input_ids=input_ids,
                    sampling_params=dataclasses.replace(sp, n=1, seed=seed),
                    stream=stream,
                    extra_key=extra_key,
                    priority=priority,
                )
            )
    return reqs


class ChoiceAccumulator:
    """Joins a group's per-request outputs into finished choices."""

    def __init__(self, want_logprobs: bool):
        self.want_logprobs = want_logprobs
        self.texts: dict[int, list[str]] = {}
        self.ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[TokenLogprob]] = {}

    def add(self, out: ReqOutput) -> ChoiceOutput | None:
        """The finished choice when `out` is its last output, else None."""
        self.texts.setdefault(out.index, []).append(out.text)
        ids = self.ids.setdefault(out.index, [])
        del ids[len(ids) - out.rollback :]
        ids.extend(out.output_ids)
        self.logprobs.setdefault(out.index, []).extend(out.logprobs)
        if out.finished_reason is None:
            return None
        return self.snapshot(out)

    def snapshot(self, out: ReqOutput) -> ChoiceOutput:
        """Choice `out.index` as accumulated so far, with `out`'s counts and reason."""
        return ChoiceOutput(
            text="".join(self.texts[out.index]),
            output_ids=list(self.ids[out.index]),
            finish_reason=out.finished_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            logprobs=tuple(self.logprobs[out.index]) if self.want_logprobs else None,
        )


def raise_if_aborted(out: ReqOutput) -> None:
    """An aborted OpenAI choice fails the whole request, with the worker's status (400
    when it refused the request, 500 otherwise)."""
    reason = out.finished_reason
    if reason is not None and reason.type == "abort":
        raise RequestError(
            reason.message or "the request was aborted",
            code="request_aborted",
            status=reason.status_code or 500,
        )


async def until_disconnected(request: Request) -> None:
    """Returns when the client goes away (call only once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Callable[[], Any]) -> Any:
    """`await work()`, cancelled if the client disconnects first; cancelling a group's
    iteration aborts its requests in the worker. Returns None after a disconnect."""
    task = asyncio.ensure_future(work())
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        logger.info("client disconnected; aborted its request")
        return None
    return task.result()


# ----- OpenAI endpoints ---------------------------------------------------------------------


@dataclass(frozen=True)
class _OpenAIEndpoint:
    """What differs between chat and completions."""

    request_model: type[ChatCompletionRequest | CompletionRequest]
    id_prefix: str
    stream_cls: type[ChatCompletionStream | CompletionStream]
    build_response: Callable[[ResponseHeader, list[ChoiceOutput], int], BaseModel]

    def prompts(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        tokenizer: PreTrainedTokenizerBase | None,
        vocab_size: int,
    ) -> list[list[int]]:
        if isinstance(request, CompletionRequest):
            return tokenize_prompts(request, tokenizer, vocab_size)
        if tokenizer is None:
            raise RequestError(
                "chat needs a tokenizer; this server was started without one", param="messages"
            )
        return [apply_chat_template(tokenizer, request.messages)]


CHAT = _OpenAIEndpoint(
    ChatCompletionRequest,
    "chatcmpl",
    ChatCompletionStream,
    lambda header, choices, n: chat_completion_response(header, choices),
)
COMPLETIONS = _OpenAIEndpoint(CompletionRequest, "cmpl", CompletionStream, completion_response)


async def _serve_openai(request: Request, endpoint: _OpenAIEndpoint) -> Response:
    state: _AppState = request.app.state.radixserve
    body = await parse_body(request, endpoint.request_model)
    check_model(body, state.settings.served_model_name)
    info = state.manager.require_ready()
    num_prompts = len(body.prompt) if isinstance(body, CompletionRequest) else 1
    check_fan_out(num_prompts, "prompt")
    check_fan_out(num_prompts * body.n, "n")
    with maybe_span(state.tracing, "tokenize"):
        prompts = endpoint.prompts(body, state.tokenizer, info.vocab_size)
    params = [state.sampling_params(body, len(ids)) for ids in prompts]
    header = ResponseHeader.new(state.settings.served_model_name, endpoint.id_prefix)
    reqs = fan_out(header.id, prompts, params, body.n, body.stream, body.cache_salt, body.priority)
    state.manager.check_capacity(len(reqs))  # before a stream's 200: shedding is a real 429
    want_logprobs = params[0].logprobs
    if body.stream:
        stream = endpoint.stream_cls(header, n=body.n, include_usage=body.include_usage)
        return StreamingResponse(
            _openai_events(state.manager, reqs, stream, want_logprobs),
            media_type="text/event-stream",
        )

    async def collect() -> BaseModel:
        choices: dict[int, ChoiceOutput] = {}
        acc = ChoiceAccumulator(want_logprobs)
        async with aclosing(state.manager.generate(reqs)) as outputs:
            async for out in outputs:
                raise_if_aborted(out)
                if (choice := acc.add(out)) is not None:
                    choices[out.index] = choice
        return endpoint.build_response(header, [choices[i] for i in sorted(choices)], body.n)

    response = await unless_disconnected(request, collect)
    return Response(status_code=499) if response is None else JSONResponse(response.model_dump())


async def _openai_events(
    manager: TokenizerManager,
    reqs: list[TokenizedGenerateReqInput],
    stream: ChatCompletionStream | CompletionStream,
    want_logprobs: bool,
) -> AsyncIterator[str]:
    """SSE events of one request; a failure after the 200 is an error event, then [DONE]."""
    acc = ChoiceAccumulator(want_logprobs)
    try:
        async with aclosing(manager.generate(reqs)) as outputs:
            async for out in outputs:
                raise_if_aborted(out)
                choice = acc.add(out)
                events = (
                    stream.delta(out.index, out.text, out.logprobs)
                    if choice is None
                    else stream.finish(out.index, choice, out.text, out.logprobs)
                )
                for event in events:
                    yield event
        for event in stream.end():
            yield event
    except RequestError as err:
        for event in stream.error(err):
            yield event


async def _generate_events(
    manager: TokenizerManager, reqs: list[TokenizedGenerateReqInput], want_logprobs: bool
) -> AsyncIterator[str]:
    """SGLang's native stream: each event is the answer so far of one request (cumulative
    text and ids, with `index`); then [DONE]."""
    acc = ChoiceAccumulator(want_logprobs)
    try:
        async with aclosing(manager.generate(reqs)) as outputs:
            async for out in outputs:
                acc.add(out)
                choice = acc.snapshot(out)
                if out.finished_reason is not None:
                    answer = generate_response(choice)
                else:
                    meta_info = {
                        "prompt_tokens": choice.prompt_tokens,
                        "completion_tokens": choice.completion_tokens,
                        "cached_tokens": choice.cached_tokens,
                        "finish_reason": None,
                    }
                    answer = {
                        "text": choice.text,
                        "output_ids": choice.output_ids,
                        "meta_info": meta_info,
                    }
                yield sse_event({**answer, "index": out.index})
    except RequestError as err:
        yield sse_event(error_body(err))
    yield SSE_DONE


# ----- the app ------------------------------------------------------------------------------


@dataclass
class _AppState:
    settings: Settings
    tokenizer: PreTrainedTokenizerBase | None
    manager: TokenizerManager
    started: int
    tracing: Tracing | None

    def sampling_params(
        self, body: ChatCompletionRequest | CompletionRequest | GenerateRequest, prompt_len: int
    ) -> SamplingParams:
        info = self.manager.require_ready()
        return to_sampling_params(
            body,
            prompt_len,
            max_tokens_cap=self.settings.max_tokens_cap,
            context_len=info.context_length,
            vocab_size=info.vocab_size,
            grammar_max_bytes=self.settings.grammar_max_bytes,
            grammar_max_nesting_depth=self.settings.grammar_max_nesting_depth,
        )


def create_app(
    settings: Settings,
    tokenizer: PreTrainedTokenizerBase | None,
    max_body_bytes: int = MAX_REQUEST_BODY_BYTES,
) -> FastAPI:
    """The ASGI app; its TokenizerManager (and so its sockets) lives as long as the app runs."""

    registry = CollectorRegistry()
    metrics = TokenizerMetrics(registry, settings.served_model_name)
    tracing = setup_tracing("tokenizer")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with running_manager(settings, tokenizer, metrics, tracing) as manager:
                app.state.radixserve = _AppState(
                    settings, tokenizer, manager, int(time.time()), tracing
                )
                yield
        finally:
            if tracing is not None:
                tracing.shutdown()

    app = FastAPI(
        title="radixserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    _add_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyAuth, api_key=settings.api_key)

    def state(request: Request) -> _AppState:
        return request.app.state.radixserve

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve_openai(request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve_openai(request, COMPLETIONS)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        st = state(request)
        info = st.manager.worker_info
        return model_list(
            st.settings.served_model_name, info and info.context_length, st.started
        ).model_dump()

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        st = state(request)
        body = await parse_body(request, GenerateRequest)
        info = st.manager.require_ready()
        check_fan_out(len(body.prompts), body.prompt_field)
        with maybe_span(st.tracing, "tokenize"):
            prompts = tokenize_prompts(body, st.tokenizer, info.vocab_size)
        params = [st.sampling_params(body, len(ids)) for ids in prompts]
        n = params[0].n
        check_fan_out(len(prompts) * n, "sampling_params.n")
        reqs = fan_out(st.manager.new_rid("gen"), prompts, params, n, body.stream)
        st.manager.check_capacity(len(reqs))
        want_logprobs = params[0].logprobs
        if body.stream:
            return StreamingResponse(
                _generate_events(st.manager, reqs, want_logprobs), media_type="text/event-stream"
            )

        async def collect() -> list[dict[str, Any]]:
            results: dict[int, dict[str, Any]] = {}
            acc = ChoiceAccumulator(want_logprobs)
            async with aclosing(st.manager.generate(reqs)) as outputs:
                async for out in outputs:
                    if (choice := acc.add(out)) is not None:
                        results[out.index] = {**generate_response(choice), "index": out.index}
            return [results[i] for i in sorted(results)]

        results = await unless_disconnected(request, collect)
        if results is None:
            return Response(status_code=499)
        return JSONResponse(results if body.is_batch or len(results) > 1 else results[0])

    @app.get("/health")
    async def health(request: Request) -> Response:
        try:
            state(request).manager.require_ready()
        except RequestError as err:
            return JSONResponse(error_body(err), err.status)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> Response:
        """Liveness of this process alone: a dead peer must not get it restarted too."""
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """Readiness proven end to end: one token through worker and detokenizer."""
        st = state(request)
        info = st.manager.require_ready()
        probe = TokenizedGenerateReqInput(
            rid=st.manager.new_rid("health"),
            input_ids=[info.eos_token_ids[0] if info.eos_token_ids else 0],
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
        )

        async def run() -> None:
            async with aclosing(st.manager.generate([probe], observed=False)) as outputs:
                async for _ in outputs:
                    pass

        try:
            await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            raise unavailable(f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s") from None
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> dict[str, Any]:
        st = state(request)
        info = st.manager.require_ready()
        return {
            "model_path": st.settings.model,
            "tokenizer_path": st.settings.tokenizer or st.settings.model,
            "served_model_name": st.settings.served_model_name,
            "is_generation": True,
            "context_length": info.context_length,
            "vocab_size": info.vocab_size,
            "max_total_tokens": info.max_total_tokens,
            "eos_token_ids": info.eos_token_ids,
        }

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> dict[str, Any]:
        """The settings (never the API key) and the worker's live state; the worker's
        values win where both have one (the KV size it actually allocated).
        `?check_integrity=true` adds `radix_integrity` ("ok", "failed: ...", or "skipped"
        while requests run): the radix tree's full check, a debugging aid."""
        st = state(request)
        check = request.query_params.get("check_integrity", "").lower() in ("1", "true", "yes")
        settings = {k: v for k, v in dataclasses.asdict(st.settings).items() if k != "api_key"}
        info = await st.manager.server_info(check_integrity=check)
        return {
            **settings,
            **info,
            "num_in_flight_requests": st.manager.num_in_flight(),
            "num_queued_requests": st.manager.num_queued,
        }

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        reply = await state(request).manager.flush_cache()
        if not reply.success:
            raise RequestError(reply.message, code="requests_in_flight", status=409)
        return JSONResponse({"message": reply.message})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, int]:
        body = await parse_body(request, AbortRequestInput)
        if not body.rid and not body.abort_all:
            raise RequestError("give a rid, or abort_all: true", param="rid")
        return {"aborted": state(request).manager.abort("" if body.abort_all else body.rid)}

    routes = frozenset(route.path for route in app.routes)
    app.add_middleware(RequestMetrics, metrics=metrics, routes=routes)
    if tracing is not None:
        app.add_middleware(TraceRequests, tracing=tracing, routes=routes)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's body; a bug is logged here and shown to nobody."""

    @app.exception_handler(RequestError)
    async def request_error(request: Request, err: RequestError) -> JSONResponse:
        return JSONResponse(error_body(err), err.status)

    @app.exception_handler(ValidationError)
    @app.exception_handler(RequestValidationError)
    async def invalid(
        request: Request, exc: ValidationError | RequestValidationError
    ) -> JSONResponse:
        return JSONResponse(validation_error_body(exc), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(
            error_body(RequestError(str(exc.detail), code=code, status=exc.status_code)),
            exc.status_code,
        )

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        err = RequestError(
            "internal server error; see the server log", code="internal_error", status=500
        )
        return JSONResponse(error_body(err), 500)
