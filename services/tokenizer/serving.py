"""The request flow that chat, completions and SGLang's native `/generate` share, and the
small `Endpoint` adapters that say how each differs (endpoints and fields: docs/api.md).

`serve` takes every generation request through the same steps:

1. refuse what is wrong before the prompt is tokenized: another model, too many sequences;
2. tokenize, and map the body onto one `SamplingParams` per prompt (`adapters`);
3. fan out `n` requests per prompt, refuse them with a 429 while the server sheds load,
   and submit them to the `TokenizerManager` as one group;
4. stream the outputs as server-sent events, or collect them into one JSON answer.

A failure before the response starts is raised as a `RequestError`, which the app answers
with OpenAI's error body (`server.create_app`); once a stream has started it can only be an
event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from engine.sampling.sampling_params import MAX_SEED, SamplingParams
from observability.tracing import Tracing, maybe_span
from services.protocol import TokenizedGenerateReqInput
from services.settings import Settings
from services.tokenizer.adapters import (
    RequestError,
    apply_chat_template,
    check_model,
    error_body,
    to_sampling_params,
    tokenize_prompts,
)
from services.tokenizer.manager import ReqOutput, TokenizerManager
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
    generate_progress,
    generate_response,
    sse_event,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MAX_SEQUENCES_PER_REQUEST = 1024
"""Prompts × n of one HTTP request. Past it the request is refused (400) before it is
tokenized or fanned out, so one body cannot become millions of requests (OpenAI caps n at
128)."""

BodyT = TypeVar("BodyT", bound=BaseModel)
GenerationBody = ChatCompletionRequest | CompletionRequest | GenerateRequest


def served_model(settings: Settings) -> str:
    """The model id of the API (`Settings` fills `served_model_name` in from `model`)."""
    return settings.model if settings.served_model_name is None else settings.served_model_name


@dataclass
class AppState:
    """What the handlers share, set once the app has started (`server.create_app`)."""

    settings: Settings
    tokenizer: PreTrainedTokenizerBase | None
    manager: TokenizerManager
    registry: CollectorRegistry
    tracing: Tracing | None
    started: int
    """When the server started (unix seconds): `/v1/models`' `created`."""

    @property
    def model(self) -> str:
        return served_model(self.settings)

    def sampling_params(self, body: GenerationBody, prompt_len: int) -> SamplingParams:
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


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.radixserve
    return state


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
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


# ----- the endpoints ------------------------------------------------------------------------


class Endpoint(ABC):
    """One request to a generation endpoint: the parts of `serve` that differ between
    chat, completions and `/generate`. `end` and `error` default to a stream that closes
    with `[DONE]`."""

    id_prefix: str
    prompt_param: str
    """The field named when a request has too many prompts."""
    n_param: str
    """The field named when prompts × n is too many."""

    def __init__(self, body: GenerationBody, num_prompts: int, n: int | None = None):
        self.body = body
        self.num_prompts = num_prompts
        self.n = n
        """`n` when the body states it itself, so it is checked before tokenizing."""
        self.id = TokenizerManager.new_rid(self.id_prefix)
        """The id of the whole request; its requests' rids are `<id>-<choice>`, so
        `/abort_request` with the id aborts them all."""
        self.extra_key: str | None = None
        self.priority = 0

    @abstractmethod
    def check(self) -> None:
        """Raises `RequestError` for what is refused before the server's readiness is even
        looked at."""

    @abstractmethod
    def tokenize(
        self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
    ) -> list[list[int]]:
        """The prompts' token ids."""

    @abstractmethod
    def check_output(self, out: ReqOutput) -> None:
        """Raises `RequestError` for an output that fails the whole request."""

    @abstractmethod
    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[str]:
        """The SSE events for `out`; `choice` is the choice it finished, if any."""

    def end(self) -> list[str]:
        """The events after every choice has finished."""
        return [SSE_DONE]

    def error(self, err: RequestError) -> list[str]:
        """The events that end a stream failed after its 200."""
        return [sse_event(error_body(err)), SSE_DONE]

    @abstractmethod
    def answer(self, choices: list[ChoiceOutput]) -> Any:
        """The JSON answer of a request not streamed, from its finished choices in order."""


class _OpenAIEndpoint(Endpoint):
    """Chat and completions: only the served model is answered, an aborted choice fails
    the whole request, and the answer is OpenAI's response object or chunk stream."""

    n_param = "n"
    body: ChatCompletionRequest | CompletionRequest
    stream: ChatCompletionStream | CompletionStream

    def __init__(
        self, body: ChatCompletionRequest | CompletionRequest, num_prompts: int, model: str
    ):
        super().__init__(body, num_prompts, body.n)
        self.model = model
        self.header = ResponseHeader(id=self.id, model=model, created=int(time.time()))
        self.extra_key, self.priority = body.cache_salt, body.priority

    def check(self) -> None:
        check_model(self.body, self.model)

    def check_output(self, out: ReqOutput) -> None:
        raise_if_aborted(out)

    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[str]:
        if choice is None:
            return self.stream.delta(out.index, out.text, out.logprobs)
        return self.stream.finish(out.index, choice, out.text, out.logprobs)

    def end(self) -> list[str]:
        return self.stream.end()

    def error(self, err: RequestError) -> list[str]:
        return self.stream.error(err)


class ChatEndpoint(_OpenAIEndpoint):
    """`/v1/chat/completions`: one prompt, the messages through the model's chat template."""

    id_prefix = "chatcmpl"
    prompt_param = "messages"
    body: ChatCompletionRequest

    def __init__(self, body: ChatCompletionRequest, model: str):
        super().__init__(body, 1, model)
        self.stream = ChatCompletionStream(self.header, n=body.n, include_usage=body.include_usage)

    def tokenize(
        self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
    ) -> list[list[int]]:
        if tokenizer is None:
            raise RequestError(
                "chat needs a tokenizer; this server was started without one", param="messages"
            )
        return [apply_chat_template(tokenizer, self.body.messages)]

    def answer(self, choices: list[ChoiceOutput]) -> Any:
        return chat_completion_response(self.header, choices).model_dump()


class CompletionsEndpoint(_OpenAIEndpoint):
    """`/v1/completions`: a batch of prompts, texts or token ids."""

    id_prefix = "cmpl"
    prompt_param = "prompt"
    body: CompletionRequest

    def __init__(self, body: CompletionRequest, model: str):
        super().__init__(body, len(body.prompt), model)
        self.stream = CompletionStream(self.header, n=body.n, include_usage=body.include_usage)

    def tokenize(
        self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
    ) -> list[list[int]]:
        return tokenize_prompts(self.body, tokenizer, vocab_size)

    def answer(self, choices: list[ChoiceOutput]) -> Any:
        return completion_response(self.header, choices, self.body.n).model_dump()


class GenerateEndpoint(Endpoint):
    """SGLang's native `/generate`: `n` is one of the `sampling_params`, an abort is a
    finish reason rather than an error, each stream event is one prompt's answer so far,
    and one prompt sent alone is answered with one object rather than a list."""

    id_prefix = "gen"
    n_param = "sampling_params.n"
    body: GenerateRequest

    def __init__(self, body: GenerateRequest):
        super().__init__(body, len(body.prompts))
        self.prompt_param = body.prompt_field

    def check(self) -> None:
        """Nothing: the native API names no model."""

    def check_output(self, out: ReqOutput) -> None:
        """Nothing fails a native request: an abort is its finish reason."""

    def tokenize(
        self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
    ) -> list[list[int]]:
        return tokenize_prompts(self.body, tokenizer, vocab_size)

    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[str]:
        if choice is not None:
            answer = generate_response(choice)
        else:
            answer = generate_progress(
                acc.text(out.index),
                acc.output_ids(out.index),
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                cached_tokens=out.cached_tokens,
            )
        return [sse_event({**answer, "index": out.index})]

    def answer(self, choices: list[ChoiceOutput]) -> Any:
        results = [{**generate_response(c), "index": i} for i, c in enumerate(choices)]
        return results if self.body.is_batch or len(results) > 1 else results[0]


# ----- the flow -----------------------------------------------------------------------------


async def serve(request: Request, endpoint: Endpoint) -> Response:
    """Check, tokenize and submit `endpoint`'s request; its answer streamed or whole (a
    499 with no body when the client left first)."""
    state = app_state(request)
    endpoint.check()
    info = state.manager.require_ready()
    check_fan_out(endpoint.num_prompts, endpoint.prompt_param)
    if endpoint.n is not None:
        check_fan_out(endpoint.num_prompts * endpoint.n, endpoint.n_param)
    with maybe_span(state.tracing, "tokenize"):
        prompts = endpoint.tokenize(state.tokenizer, info.vocab_size)
    params = [state.sampling_params(endpoint.body, len(ids)) for ids in prompts]
    n = params[0].n
    check_fan_out(len(prompts) * n, endpoint.n_param)
    reqs = fan_out(
        endpoint.id, prompts, params, n, endpoint.body.stream, endpoint.extra_key, endpoint.priority
    )
    state.manager.check_capacity(len(reqs))  # before a stream's 200: shedding is a real 429
    acc = ChoiceAccumulator(want_logprobs=params[0].logprobs)
    if endpoint.body.stream:
        return StreamingResponse(
            _events(state.manager, reqs, endpoint, acc), media_type="text/event-stream"
        )
    answer = await unless_disconnected(
        request, lambda: _collect(state.manager, reqs, endpoint, acc)
    )
    return Response(status_code=499) if answer is None else JSONResponse(answer)


def check_fan_out(num_sequences: int, param: str) -> None:
    if num_sequences > MAX_SEQUENCES_PER_REQUEST:
        raise RequestError(
            f"this request asks for {num_sequences} sequences (prompts × n); "
            f"at most {MAX_SEQUENCES_PER_REQUEST} are served per request",
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
    reqs: list[TokenizedGenerateReqInput] = []
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


async def _events(
    manager: TokenizerManager,
    reqs: list[TokenizedGenerateReqInput],
    endpoint: Endpoint,
    acc: ChoiceAccumulator,
) -> AsyncIterator[str]:
    """SSE events of one request; a failure after the 200 is the endpoint's error events."""
    try:
        async with aclosing(manager.generate(reqs)) as outputs:
            async for out in outputs:
                endpoint.check_output(out)
                for event in endpoint.events(out, acc.add(out), acc):
                    yield event
        for event in endpoint.end():
            yield event
    except RequestError as err:
        for event in endpoint.error(err):
            yield event


async def _collect(
    manager: TokenizerManager,
    reqs: list[TokenizedGenerateReqInput],
    endpoint: Endpoint,
    acc: ChoiceAccumulator,
) -> Any:
    """The endpoint's answer once every choice has finished."""
    choices: dict[int, ChoiceOutput] = {}
    async with aclosing(manager.generate(reqs)) as outputs:
        async for out in outputs:
            endpoint.check_output(out)
            if (choice := acc.add(out)) is not None:
                choices[out.index] = choice
    return endpoint.answer([choices[i] for i in sorted(choices)])


class ChoiceAccumulator:
    """Joins a group's per-request outputs into its choices."""

    def __init__(self, want_logprobs: bool):
        self.want_logprobs = want_logprobs
        self.texts: dict[int, list[str]] = {}
        self.ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[TokenLogprob]] = {}

    def add(self, out: ReqOutput) -> ChoiceOutput | None:
        """Adds `out` to its choice; the finished choice when `out` is its last output."""
        self.texts.setdefault(out.index, []).append(out.text)
        ids = self.ids.setdefault(out.index, [])
        del ids[len(ids) - out.rollback :]
        ids.extend(out.output_ids)
        self.logprobs.setdefault(out.index, []).extend(out.logprobs)
        if out.finished_reason is None:
            return None
        return ChoiceOutput(
            text=self.text(out.index),
            output_ids=self.output_ids(out.index),
            finish_reason=out.finished_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            logprobs=tuple(self.logprobs[out.index]) if self.want_logprobs else None,
        )

    def text(self, index: int) -> str:
        """Choice `index`'s text so far."""
        return "".join(self.texts[index])

    def output_ids(self, index: int) -> list[int]:
        """Choice `index`'s token ids so far."""
        return list(self.ids[index])


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


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[Any]]) -> Any:
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
