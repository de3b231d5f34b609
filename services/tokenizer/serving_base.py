"""The request flow that chat, completions, the Responses API and SGLang's native
`/generate` share, and the `Endpoint` base whose subclasses say how each differs
(`serving_chat`, `serving_completions`, `serving_generate`, `serving_responses`; endpoints
and fields: docs/api.md; a chat request's path through it: docs/architecture.md, "A chat
request's path").

`serve` takes every generation request through one flow, prepare → admit → submit → stream:

1. `prepare` builds one `PreparedRequest`: it refuses what is wrong before the prompt is
   tokenized (another model, the API's own checks, more prompt text than
   `--max-prompt-chars`, `n` above `--max-n`, more sequences than
   `--max-sequences-per-request`; `request_mapper` decides each 4xx), tokenizes the prompts
   (the endpoint's `tokenize`) and maps the body onto one `SamplingParams` per prompt, in a
   worker thread unless the request is small (`off_loop`), then fans out `n` requests per
   prompt in one prefix namespace;
2. admit: `TokenizerManager.check_capacity` refuses them with a 429 while the server sheds
   load;
3. submit them to the `TokenizerManager` as one group;
4. stream the outputs as server-sent events, framed here from the endpoint's typed chunks
   (`sse.frame`), or collect them into one JSON answer.

vLLM's render endpoints (`serving_render`) stop after `prepare` and answer the prompts' ids
and parameters, so a render is what generation would submit.

A failure before the response starts is raised as a `RequestError`, which the app answers
with OpenAI's error body (`server.create_app`); once a stream has started it can only be an
event, then `[DONE]` where the API ends its streams so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from engine.cache.namespace import PrefixNamespace
from engine.sampling.sampling_params import MAX_SEED, SamplingParams
from observability.tracing import Tracing, maybe_span
from services.io_struct import TokenizedGenerateReqInput, WorkerReady
from services.settings import Settings
from services.tokenizer.chat_output import ChatParsers
from services.tokenizer.choice_output import ChoiceOutput, TokenLogprob
from services.tokenizer.errors import RequestError, error_body
from services.tokenizer.manager import ReqOutput, TokenizerManager
from services.tokenizer.middleware import cache_tenant
from services.tokenizer.request_mapper import (
    GenerationBody,
    check_request,
    prompt_chars,
    to_sampling_params,
)
from services.tokenizer.sse import SSE_DONE, Chunk, DeltaEvents, frame
from services.tokenizer.worker_metrics_proxy import WorkerMetricsProxy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

INLINE_BODY_BYTES = 4096
"""Requests with a body up to this size are tokenized on the event loop: below it the hop
to a thread costs more than the loop time it frees (docs/benchmarks/host.md, "The
tokenizer's inline thresholds"); above it the work (and a grammar's or tools' parsing, which
the body's size also bounds) runs in `_PREPARE_POOL`."""
_PREPARE_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="prepare")
"""Tokenizing, templating and grammar checks of large requests. HF fast tokenizers release
the GIL while they encode, so a 12 MiB prompt leaves the event loop (and `/healthz`)
running; threads share the tokenizer only through its read-only calls."""

BodyT = TypeVar("BodyT", bound=BaseModel)
T = TypeVar("T")


@dataclass
class AppState:
    """What the handlers share, set once the app has started (`server.create_app`)."""

    settings: Settings
    tokenizer: PreTrainedTokenizerBase | None
    manager: TokenizerManager
    registry: CollectorRegistry
    worker_metrics: WorkerMetricsProxy
    """The worker's series for `/metrics`."""
    tracing: Tracing | None
    started: int
    """When the server started (unix seconds): `/v1/models`' `created`."""

    @property
    def model(self) -> str:
        return self.settings.model_id

    @property
    def chat_parsers(self) -> ChatParsers:
        return ChatParsers(self.settings.tool_call_parser, self.settings.reasoning_parser)

    def require_tokenizer(self, param: str | None) -> PreTrainedTokenizerBase:
        """The tokenizer, or a 400 naming `param` on a server started without one."""
        if self.tokenizer is None:
            raise RequestError(
                "this needs a tokenizer; this server was started without one", param=param
            )
        return self.tokenizer

    def sampling_params(
        self,
        body: GenerationBody,
        prompt_len: int,
        info: WorkerReady,
        reasoning: bool = False,
        turn_end_ids: Sequence[int] = (),
    ) -> SamplingParams:
        """Safe off the event loop: `info` is the worker's limits, read on the loop.
        `reasoning`: a grammar waits for the end of a reasoning section the model is still
        to write. `turn_end_ids` end it as its EOS does (not under `ignore_eos`)."""
        params = to_sampling_params(
            body,
            prompt_len,
            max_tokens_cap=self.settings.max_tokens_cap,
            context_len=info.context_length,
            vocab_size=info.vocab_size,
            grammar_max_bytes=self.settings.grammar_max_bytes,
            grammar_max_nesting_depth=self.settings.grammar_max_nesting_depth,
            limits=self.settings,
            grammar_backend=self.settings.grammar_backend,
        )
        if turn_end_ids and not params.ignore_eos:
            stops = list(dict.fromkeys([*params.stop_token_ids, *turn_end_ids]))
            params = dataclasses.replace(params, stop_token_ids=stops)
        return dataclasses.replace(params, reasoning=True) if reasoning else params


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.radixserve
    return state


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
    """The JSON body as `model`; a pydantic ValidationError (malformed JSON included) is
    answered by the app's handler."""
    return model.model_validate_json(await json_body(request))


async def json_body(request: Request) -> bytes:
    """The body of a request that must be JSON: a 415 for any other Content-Type."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise RequestError(
            f"Content-Type must be application/json, got {content_type or 'none'!r}",
            code="unsupported_media_type",
            status=415,
        )
    return await request.body()


# ----- the endpoints ------------------------------------------------------------------------


class Endpoint(ABC):
    """One request to a generation endpoint: the parts of `serve` that differ between
    chat, completions, `/generate` and the Responses API. What is refused before
    tokenizing is `request_mapper`'s (`check_request`); an endpoint tokenizes its prompts,
    and turns outputs into a stream's typed chunks (`events`, `end`, `error`, which `serve`
    frames) or into one answer."""

    id_prefix: str
    n_param: str
    """The field named when `n`, or prompts × n, is too many."""
    ends_with_done = True
    """Whether the stream closes with `[DONE]`, after its last chunks or its error."""
    needs_tokenizer = False
    """Whether every request needs the tokenizer (a 400 on a server without one)."""

    def __init__(self, body: GenerationBody, model: str):
        self.body = body
        self.model = model
        """The served model."""
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        """The id of the whole request; its requests' rids are `<id>-<choice>`, so
        `/abort_request` with the id aborts them all."""
        self.created = int(time.time())
        self.lora_name: str | None = None
        """The LoRA adapter the request names (set by `prepare`); None: the base model."""
        self.grammar_after_reasoning = False
        """Set by `tokenize`: a grammar waits for the end of a reasoning section the
        prompt leaves the model to write."""
        self.turn_end_ids: tuple[int, ...] = ()
        """Set by `tokenize`: the tokens that close the chat template's turns."""

    @property
    @abstractmethod
    def prompt_param(self) -> str:
        """The field named when a request has too many prompts or too much prompt text."""

    @property
    @abstractmethod
    def num_prompts(self) -> int: ...

    @property
    @abstractmethod
    def n(self) -> int:
        """`n` as the body states it, checked before tokenizing; 1 where it does not state
        an integer (`SamplingParams.verify` refuses one that is no integer)."""

    @property
    def cache_salt(self) -> str | None:
        """The request's own prefix namespace (`cache_salt`), if it names one."""
        return None

    @property
    def priority(self) -> int:
        return 0

    @property
    def deltas(self) -> DeltaEvents | None:
        """The encoder of the stream's `TextDelta` chunks, where it has them."""
        return None

    @abstractmethod
    def tokenize(self, state: AppState, vocab_size: int) -> list[list[int]]:
        """The prompts' token ids (called off the event loop for large requests)."""

    @abstractmethod
    def check_output(self, out: ReqOutput) -> None:
        """Raises `RequestError` for an output that fails the whole request."""

    @abstractmethod
    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[Chunk]:
        """The stream's chunks for `out`; `choice` is the choice it finished, if any."""

    def end(self) -> list[Chunk]:
        """The chunks after every choice has finished."""
        return []

    def error(self, err: RequestError) -> list[Chunk]:
        """The chunks that end a stream failed after its 200."""
        return [error_body(err)]

    @abstractmethod
    def answer(self, choices: list[ChoiceOutput]) -> Any:
        """The JSON answer of a request not streamed, from its finished choices in order."""


# ----- the flow -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedRequest:
    """A request checked, tokenized and fanned out: what the worker is sent."""

    ids: list[list[int]]
    """Each prompt's token ids."""
    params: list[SamplingParams]
    """Each prompt's `SamplingParams`."""
    reqs: list[TokenizedGenerateReqInput]
    """`n` requests per prompt, in OpenAI's choice order, in the request's prefix namespace."""


async def serve(request: Request, endpoint: Endpoint) -> Response:
    """prepare → admit → submit → stream: `endpoint`'s request checked, tokenized and
    submitted; its answer streamed or whole (a 499 with no body when the client left
    first)."""
    manager = app_state(request).manager
    prepared = await prepare(request, endpoint)
    manager.check_capacity(len(prepared.reqs))  # before a stream's 200: shedding is a real 429
    acc = ChoiceAccumulator(want_logprobs=prepared.params[0].logprobs)
    if endpoint.body.stream:
        return StreamingResponse(
            _events(manager, prepared.reqs, endpoint, acc), media_type="text/event-stream"
        )
    answer = await unless_disconnected(
        request, lambda: _collect(manager, prepared.reqs, endpoint, acc)
    )
    return Response(status_code=499) if answer is None else JSONResponse(answer)


async def prepare(request: Request, endpoint: Endpoint) -> PreparedRequest:
    """Everything refused before submission is refused here, each check once; the prompts
    are tokenized (chat's through its template) and fanned out as they will be submitted.
    The render endpoints stop here, so their ids are the generation endpoints' by
    construction."""
    state = app_state(request)
    body = endpoint.body
    endpoint.lora_name = check_request(body, state.model, state.manager.lora_adapters)
    check_prompt_chars(prompt_chars(body), state.settings.max_prompt_chars, endpoint.prompt_param)
    info = state.manager.require_ready()
    check_fan_out(endpoint, state.settings)
    inline = len(await request.body()) <= INLINE_BODY_BYTES
    with maybe_span(state.tracing, "tokenize"):
        ids, params = await off_loop(lambda: _tokenized(state, endpoint, info), inline)
    namespace = PrefixNamespace.of(
        cache_salt=endpoint.cache_salt, tenant=cache_tenant(request, state.settings)
    )
    reqs = fan_out(
        endpoint.id,
        ids,
        params,
        params[0].n,
        body.stream,
        namespace,
        endpoint.priority,
        endpoint.lora_name,
    )
    return PreparedRequest(ids, params, reqs)


def _tokenized(
    state: AppState, endpoint: Endpoint, info: WorkerReady
) -> tuple[list[list[int]], list[SamplingParams]]:
    """The prompts' ids and parameters: the part of `prepare` whose time grows with the
    request (templating, tokenizing, grammar parsing), so it touches no socket."""
    if endpoint.needs_tokenizer:
        state.require_tokenizer(endpoint.prompt_param)
    prompts = endpoint.tokenize(state, info.vocab_size)
    reasoning, turn_end = endpoint.grammar_after_reasoning, endpoint.turn_end_ids
    return prompts, [
        state.sampling_params(endpoint.body, len(p), info, reasoning, turn_end) for p in prompts
    ]


async def off_loop(work: Callable[[], T], inline: bool) -> T:
    """`work()`, in a `_PREPARE_POOL` thread unless `inline`, so that a large request leaves
    the event loop free to serve probes, streams and peers' heartbeats meanwhile."""
    if inline:
        return work()
    return await asyncio.get_running_loop().run_in_executor(_PREPARE_POOL, work)


def check_prompt_chars(chars: int, limit: int, param: str) -> None:
    """`--max-prompt-chars`, checked before templating or tokenizing: the work both take
    grows with the text."""
    if chars > limit:
        raise RequestError(
            f"the prompt text is {chars} characters; at most {limit} are accepted "
            "(--max-prompt-chars)",
            param=param,
        )


def check_fan_out(endpoint: Endpoint, settings: Settings) -> None:
    """`--max-n` and `--max-sequences-per-request`, before the prompts are tokenized: the
    work of one request grows with prompts × n, and one body must not hold the worker past
    `--request-timeout` or become millions of requests. Too many prompts alone are named
    as such, before `n` is looked at."""
    num_prompts, n, limit = endpoint.num_prompts, endpoint.n, settings.max_sequences_per_request
    if num_prompts <= limit and n > settings.max_n:
        raise RequestError(
            f"{endpoint.n_param} is {n}; at most {settings.max_n} samples per prompt are "
            "served (--max-n)",
            param=endpoint.n_param,
            code="integer_above_max_value",
        )
    if num_prompts * n > limit:
        raise RequestError(
            f"this request asks for {num_prompts * n} sequences (prompts × n); at most "
            f"{limit} are served per request (--max-sequences-per-request)",
            param=endpoint.prompt_param if num_prompts > limit else endpoint.n_param,
        )


def fan_out(
    rid_prefix: str,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    n: int,
    stream: bool,
    extra_key: PrefixNamespace | None = None,
    priority: int = 0,
    lora_name: str | None = None,
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
                    lora_name=lora_name,
                )
            )
    return reqs


async def _events(
    manager: TokenizerManager,
    reqs: list[TokenizedGenerateReqInput],
    endpoint: Endpoint,
    acc: ChoiceAccumulator,
) -> AsyncIterator[str]:
    """The stream's edge: the endpoint's chunks framed as server-sent events, those of one
    output written together (one send, not one per event); a failure after the 200 is the
    endpoint's error chunks; then `[DONE]` where the API ends its streams so."""
    try:
        async with aclosing(manager.generate(reqs)) as outputs:
            async for out in outputs:
                endpoint.check_output(out)
                if chunks := endpoint.events(out, acc.add(out), acc):
                    yield frame(chunks, endpoint.deltas)
        last = endpoint.end()
    except RequestError as err:
        last = endpoint.error(err)
    yield frame(last, endpoint.deltas) + (SSE_DONE if endpoint.ends_with_done else "")


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
        self.prompt_logprobs: dict[int, tuple[TokenLogprob, ...]] = {}

    def add(self, out: ReqOutput) -> ChoiceOutput | None:
        """Adds `out` to its choice; the finished choice when `out` is its last output.
        Called per token: what an output lacks costs nothing."""
        index = out.index
        self.texts.setdefault(index, []).append(out.text)
        ids = self.ids.setdefault(index, [])
        if out.rollback:
            del ids[len(ids) - out.rollback :]
        ids.extend(out.output_ids)
        if out.logprobs:
            self.logprobs.setdefault(index, []).extend(out.logprobs)
        if out.prompt_logprobs:
            self.prompt_logprobs[index] = out.prompt_logprobs
        if out.finished_reason is None:
            return None
        return ChoiceOutput(
            text=self.text(index),
            output_ids=self.output_ids(index),
            finish_reason=out.finished_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            logprobs=tuple(self.logprobs.get(index, ())) if self.want_logprobs else None,
            prompt_logprobs=self.prompt_logprobs.get(index),
            spec_verify_ct=out.spec_verify_ct,
            spec_accept_length=out.spec_accept_length,
        )

    def text(self, index: int) -> str:
        """Choice `index`'s text so far."""
        return "".join(self.texts[index])

    def output_ids(self, index: int) -> list[int]:
        """Choice `index`'s token ids so far."""
        return list(self.ids[index])


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
