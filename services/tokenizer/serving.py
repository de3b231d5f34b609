"""The request flow that chat, completions and SGLang's native `/generate` share, and the
small `Endpoint` adapters that say how each differs (endpoints and fields: docs/api.md).

`serve` takes every generation request through the same steps:

1. refuse what is wrong before the prompt is tokenized: another model, `n` above `--max-n`,
   more sequences than `--max-sequences-per-request`, more prompt text than
   `--max-prompt-chars`;
2. tokenize, and map the body onto one `SamplingParams` per prompt (`adapters`), in a
   worker thread unless the request is small (`off_loop`);
3. fan out `n` requests per prompt, refuse them with a 429 while the server sheds load,
   and submit them to the `TokenizerManager` as one group;
4. stream the outputs as server-sent events, or collect them into one JSON answer.

Steps 1 and 2 are `prepare`; vLLM's render endpoints (`render`) stop after them and answer
the prompts' ids and parameters, so a render is what generation would submit.

A failure before the response starts is raised as a `RequestError`, which the app answers
with OpenAI's error body (`server.create_app`); once a stream has started it can only be an
event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
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
from services.tokenizer.adapters import (
    RequestError,
    check_chat_request,
    check_completion_request,
    check_model,
    error_body,
    to_sampling_params,
    tokenize_prompts,
)
from services.tokenizer.chat_output import ChatOutputFormat, ChatParsers, ChoiceParser
from services.tokenizer.chat_template import render_chat
from services.tokenizer.manager import ReqOutput, TokenizerManager
from services.tokenizer.middleware import tenant_namespace
from services.tokenizer.protocol import (
    ChatCompletionMessageParam,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    RenderedRequest,
    RenderedSamplingParams,
)
from services.tokenizer.responses import (
    REQUESTED_ABORT_STATUS,
    SSE_DONE,
    ChatCompletionStream,
    ChoiceOutput,
    CompletionStream,
    ResponseHeader,
    TokenLogprob,
    chat_completion_response,
    completion_response,
    echoed,
    generate_progress,
    generate_response,
    sse_event,
)
from services.tokenizer.responses_api import (
    ResponsesRequest,
    ResponsesStream,
    responses_error,
    to_chat_request,
    to_response,
)
from services.tokenizer.sse import DeltaEvents
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
    worker_metrics: WorkerMetricsProxy
    """The worker's series for `/metrics`."""
    tracing: Tracing | None
    started: int
    """When the server started (unix seconds): `/v1/models`' `created`."""

    @property
    def model(self) -> str:
        return served_model(self.settings)

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
        self, body: GenerationBody, prompt_len: int, info: WorkerReady
    ) -> SamplingParams:
        """Safe off the event loop: `info` is the worker's limits, read on the loop."""
        return to_sampling_params(
            body,
            prompt_len,
            max_tokens_cap=self.settings.max_tokens_cap,
            context_len=info.context_length,
            vocab_size=info.vocab_size,
            grammar_max_bytes=self.settings.grammar_max_bytes,
            grammar_max_nesting_depth=self.settings.grammar_max_nesting_depth,
            limits=self.settings,
        )


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
    chat, completions and `/generate`. `end` and `error` default to a stream that closes
    with `[DONE]`."""

    id_prefix: str
    prompt_param: str
    """The field named when a request has too many prompts."""
    n_param: str
    """The field named when `n`, or prompts × n, is too many."""

    def __init__(self, body: GenerationBody, num_prompts: int, n: int | None = None):
        self.body = body
        self.num_prompts = num_prompts
        self.n = n
        """`n` when the body states it itself, so it is checked before tokenizing."""
        self.id = TokenizerManager.new_rid(self.id_prefix)
        """The id of the whole request; its requests' rids are `<id>-<choice>`, so
        `/abort_request` with the id aborts them all."""
        self.extra_key: PrefixNamespace | None = None
        self.priority = 0
        self.lora_name: str | None = None
        """The LoRA adapter the request names (`check`); None: the base model."""

    @abstractmethod
    def check(self, adapters: Collection[str]) -> None:
        """Raises `RequestError` for what is refused before the server's readiness is even
        looked at, and sets `lora_name` from the request (one of `adapters`)."""

    @abstractmethod
    def prompt_chars(self) -> int:
        """The characters of prompt text the request sends (token ids count none)."""

    @abstractmethod
    def tokenize(self, state: AppState, vocab_size: int) -> list[list[int]]:
        """The prompts' token ids (called off the event loop for large requests)."""

    def sampling_params(
        self, state: AppState, prompt_len: int, info: WorkerReady
    ) -> SamplingParams:
        """One prompt's `SamplingParams`, from the body."""
        return state.sampling_params(self.body, prompt_len, info)

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
    deltas: DeltaEvents
    """Plain text deltas of `stream`, framed from pre-encoded chunks."""

    def __init__(
        self, body: ChatCompletionRequest | CompletionRequest, num_prompts: int, model: str
    ):
        super().__init__(body, num_prompts, body.n)
        self.model = model
        # `check` refuses any model but this one and its adapters: the name sent is served.
        served = body.model or model
        self.header = ResponseHeader(id=self.id, model=served, created=int(time.time()))
        self.extra_key = PrefixNamespace.of(cache_salt=body.cache_salt)
        self.priority = body.priority

    def check(self, adapters: Collection[str]) -> None:
        self.lora_name = check_model(self.body.model, self.model, adapters)

    def check_output(self, out: ReqOutput) -> None:
        raise_if_aborted(out, self.body.stream)

    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[str]:
        if choice is None:
            if not out.logprobs and out.index in self.stream.text_offsets:
                return self.deltas.delta(out.index, out.text)  # the per-token hot path
            return self.stream.delta(out.index, out.text, out.logprobs)
        return self.stream.finish(out.index, choice, out.text, out.logprobs)

    def end(self) -> list[str]:
        return self.stream.end()

    def error(self, err: RequestError) -> list[str]:
        return self.stream.error(err)


class ChatEndpoint(_OpenAIEndpoint):
    """`/v1/chat/completions`: one prompt, the messages (and tools) through the model's chat
    template; the output split into reasoning, content and tool calls (`chat_output`)."""

    id_prefix = "chatcmpl"
    prompt_param = "messages"
    body: ChatCompletionRequest

    def __init__(self, body: ChatCompletionRequest, model: str, parsers: ChatParsers):
        super().__init__(body, 1, model)
        self.stream = ChatCompletionStream(self.header, n=body.n, include_usage=body.include_usage)
        self.deltas = DeltaEvents(self.stream)
        self.parsers = parsers
        self.format: ChatOutputFormat | None = None
        """Set once the prompt is rendered: whether it left the model inside a reasoning
        section decides how the output is read."""
        self.choice_parsers: dict[int, ChoiceParser] = {}

    def check(self, adapters: Collection[str]) -> None:
        super().check(adapters)
        check_chat_request(self.body)

    def prompt_chars(self) -> int:
        return chat_prompt_chars(self.body.messages)

    def tokenize(self, state: AppState, vocab_size: int) -> list[list[int]]:
        tokenizer = state.require_tokenizer(self.prompt_param)
        body = self.body
        prompt = render_chat(
            tokenizer,
            body.messages,
            tools=body.tools if body.effective_tool_choice != "none" else None,
            template_kwargs=body.chat_template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            special_tokens_in_content=state.settings.allow_special_tokens_in_content,
        )
        self.format = ChatOutputFormat.for_request(
            body,
            self.parsers,
            starts_in_reasoning=prompt.opens_reasoning,
            reasoning_closed=prompt.reasoning_closed,
        )
        return [prompt.ids]

    def sampling_params(
        self, state: AppState, prompt_len: int, info: WorkerReady
    ) -> SamplingParams:
        """A grammar waits for the end of a reasoning section the model is still to write."""
        params = super().sampling_params(state, prompt_len, info)
        fmt = self.format
        if fmt is not None and fmt.reasoning_parser is not None and fmt.enable_thinking:
            params = dataclasses.replace(params, reasoning=True)
        return params

    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[str]:
        fmt = self.format
        if fmt is None or fmt.plain:
            return super().events(out, choice, acc)
        parser = self.choice_parsers.setdefault(out.index, ChoiceParser(fmt))
        delta = parser.feed(out.text)
        if choice is None:
            return self.stream.delta(out.index, delta.content, out.logprobs, delta)
        delta += parser.finish()
        return self.stream.finish(
            out.index, choice, delta.content, out.logprobs, delta, parser.finish_reason
        )

    def answer(self, choices: list[ChoiceOutput]) -> Any:
        return chat_completion_response(self.header, choices, self.format).model_dump()


class ResponsesEndpoint(ChatEndpoint):
    """`/v1/responses`: the request translated into a chat completion
    (`responses_api.to_chat_request`), served as one, and its answer or chunk stream
    translated back into a Response and its events. Stateless: nothing is stored."""

    id_prefix = "resp"
    prompt_param = "input"

    def __init__(self, request: ResponsesRequest, model: str, parsers: ChatParsers):
        body = ChatCompletionRequest.model_validate(to_chat_request(request))
        super().__init__(body, model, parsers)
        self.request = request
        self.responses = ResponsesStream(request, self.id, self.header.created, model)
        self.started = False

    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[str]:
        opening = [] if self.started else self.responses.start()
        self.started = True
        return opening + self._translated(super().events(out, choice, acc))

    def end(self) -> list[str]:
        return self._translated(super().end()) + self.responses.finish()

    def error(self, err: RequestError) -> list[str]:
        return self.responses.error(responses_error(err))

    def answer(self, choices: list[ChoiceOutput]) -> Any:
        chat = super().answer(choices)
        return to_response(self.request, chat, self.id, self.header.created)

    def _translated(self, chat_events: list[str]) -> list[str]:
        events: list[str] = []
        for event in chat_events:
            if event != SSE_DONE:
                events += self.responses.feed(json.loads(event.removeprefix("data: ")))
        return events


class CompletionsEndpoint(_OpenAIEndpoint):
    """`/v1/completions`: a batch of prompts, texts or token ids."""

    id_prefix = "cmpl"
    prompt_param = "prompt"
    body: CompletionRequest

    def __init__(self, body: CompletionRequest, model: str):
        super().__init__(body, len(body.prompt), model)
        self.stream = CompletionStream(self.header, n=body.n, include_usage=body.include_usage)
        self.deltas = DeltaEvents(self.stream)
        self.prompt_texts: list[str] = []
        """With `echo`: each prompt as text."""

    def check(self, adapters: Collection[str]) -> None:
        super().check(adapters)
        check_completion_request(self.body)

    def prompt_chars(self) -> int:
        return _text_chars(self.body.prompt)

    def tokenize(self, state: AppState, vocab_size: int) -> list[list[int]]:
        tokenizer = state.tokenizer
        prompts = tokenize_prompts(self.body, tokenizer, vocab_size)
        if self.body.echo:
            texts = self.body.prompt
            self.prompt_texts = [
                text if isinstance(text, str) else _decoded(tokenizer, ids)
                for text, ids in zip(texts, prompts)
            ]
        return prompts

    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[str]:
        """With `echo`, a choice's first chunk opens with its prompt (and its logprobs,
        which come with the choice's first output)."""
        if self.body.echo and out.index not in self.stream.text_offsets:
            prompt = self.prompt_texts[out.index // self.body.n]
            logprobs = (*out.prompt_logprobs, *out.logprobs) if acc.want_logprobs else ()
            out = dataclasses.replace(out, text=prompt + out.text, logprobs=logprobs)
        return super().events(out, choice, acc)

    def answer(self, choices: list[ChoiceOutput]) -> Any:
        if self.body.echo:
            n = self.body.n
            choices = [echoed(self.prompt_texts[i // n], c) for i, c in enumerate(choices)]
        vllm_prompt = self.body.prompt_logprobs is not None
        return completion_response(self.header, choices, self.body.n, vllm_prompt).model_dump()


def chat_prompt_chars(messages: Sequence[ChatCompletionMessageParam]) -> int:
    """The characters of a conversation's text: its contents and earlier calls' arguments."""
    return sum(
        len(m.content or "") + sum(len(c.function.arguments) for c in m.tool_calls or ())
        for m in messages
    )


def _text_chars(prompts: Sequence[str | list[int]]) -> int:
    """The characters of a batch's text prompts; the caller writes their markup, so their
    special tokens are parsed (as OpenAI's completions do)."""
    return sum(len(p) for p in prompts if isinstance(p, str))


def _decoded(tokenizer: PreTrainedTokenizerBase | None, ids: list[int]) -> str:
    """A token-id prompt as text, for echo: "" on a server without a tokenizer."""
    if tokenizer is None:
        return ""
    text = tokenizer.decode(ids)
    assert isinstance(text, str), "one id list decodes to one text"
    return text


class GenerateEndpoint(Endpoint):
    """SGLang's native `/generate`: `n` is one of the `sampling_params`, an abort is a
    finish reason rather than an error, each stream event is one prompt's answer so far,
    and one prompt sent alone is answered with one object rather than a list."""

    id_prefix = "gen"
    n_param = "sampling_params.n"
    body: GenerateRequest

    def __init__(self, body: GenerateRequest, model: str):
        n = body.sampling_params.get("n")
        stated = isinstance(n, int) and not isinstance(n, bool)
        super().__init__(body, len(body.prompts), n if stated else None)
        self.prompt_param = body.prompt_field
        self.model = model

    def check(self, adapters: Collection[str]) -> None:
        """The native API names no model, only a LoRA adapter (`lora_path`)."""
        self.lora_name = check_model(self.body.lora_path, self.model, adapters, "lora_path")

    def check_output(self, out: ReqOutput) -> None:
        """Nothing fails a native request: an abort is its finish reason."""

    def prompt_chars(self) -> int:
        return _text_chars(self.body.prompts)

    def tokenize(self, state: AppState, vocab_size: int) -> list[list[int]]:
        return tokenize_prompts(self.body, state.tokenizer, vocab_size)

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


@dataclass(frozen=True)
class PreparedPrompts:
    """A request checked and tokenized: what the worker would be sent, before the fan-out."""

    ids: list[list[int]]
    """Each prompt's token ids."""
    params: list[SamplingParams]
    """Each prompt's `SamplingParams`."""


async def prepare(request: Request, endpoint: Endpoint) -> PreparedPrompts:
    """Steps 1 and 2 of `serve`: everything refused before submission is refused here, and
    the prompts are tokenized (chat's through its template) as they will be submitted. The
    render endpoints stop here, so their ids are the generation endpoints' by construction."""
    state = app_state(request)
    endpoint.check(state.manager.lora_adapters)
    check_prompt_chars(
        endpoint.prompt_chars(), state.settings.max_prompt_chars, endpoint.prompt_param
    )
    info = state.manager.require_ready()
    check_fan_out(endpoint.num_prompts, 1, endpoint, state.settings)
    if endpoint.n is not None:
        check_fan_out(endpoint.num_prompts, endpoint.n, endpoint, state.settings)
    inline = len(await request.body()) <= INLINE_BODY_BYTES
    with maybe_span(state.tracing, "tokenize"):
        prepared = await off_loop(lambda: _tokenized(state, endpoint, info), inline)
    check_fan_out(len(prepared.ids), prepared.params[0].n, endpoint, state.settings)
    return prepared


def _tokenized(state: AppState, endpoint: Endpoint, info: WorkerReady) -> PreparedPrompts:
    """The prompts' ids and parameters: the part of `prepare` whose time grows with the
    request (templating, tokenizing, grammar parsing), so it touches no socket."""
    prompts = endpoint.tokenize(state, info.vocab_size)
    return PreparedPrompts(
        prompts, [endpoint.sampling_params(state, len(ids), info) for ids in prompts]
    )


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


async def serve(request: Request, endpoint: Endpoint) -> Response:
    """Check, tokenize and submit `endpoint`'s request; its answer streamed or whole (a
    499 with no body when the client left first)."""
    state = app_state(request)
    prepared = await prepare(request, endpoint)
    prompts, params = prepared.ids, prepared.params
    n = params[0].n
    extra_key = tenant_namespace(request, state.settings, endpoint.extra_key)
    reqs = fan_out(
        endpoint.id,
        prompts,
        params,
        n,
        endpoint.body.stream,
        extra_key,
        endpoint.priority,
        endpoint.lora_name,
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


async def render(
    request: Request, endpoint: ChatEndpoint | CompletionsEndpoint
) -> list[RenderedRequest]:
    """vLLM's render endpoints: per prompt, the token ids and sampling parameters the worker
    would be sent (`prepare`), in vLLM's `GenerateRequest` shape. Nothing is submitted."""
    body = endpoint.body
    prepared = await prepare(request, endpoint)
    return [
        RenderedRequest(
            request_id=TokenizerManager.new_rid(endpoint.id_prefix),
            token_ids=ids,
            sampling_params=vllm_sampling_params(params),
            model=body.model,
            stream=body.stream,
            stream_options=body.stream_options if body.stream else None,
            cache_salt=body.cache_salt,
            priority=body.priority,
        )
        for ids, params in zip(prepared.ids, prepared.params)
    ]


_VLLM_GRAMMAR_KEYS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
"""vLLM's `structured_outputs` key for each grammar kind (a `choice` is already an EBNF)."""


def vllm_sampling_params(params: SamplingParams) -> RenderedSamplingParams:
    """`params` under vLLM's names: logprobs as a count (None: not asked), the prompt's
    logprobs likewise, a grammar as `structured_outputs`."""
    structured: dict[str, Any] | None = None
    if params.grammar is not None:
        kind, source = params.grammar
        key = _VLLM_GRAMMAR_KEYS[kind]
        structured = {key: json.loads(source) if kind == "json_schema" else source}
    return RenderedSamplingParams(
        n=params.n,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        max_tokens=params.max_new_tokens,
        min_tokens=params.min_new_tokens,
        logprobs=params.top_logprobs_num if params.logprobs else None,
        prompt_logprobs=params.prompt_top_logprobs_num if params.logprob_start_len >= 0 else None,
        skip_special_tokens=params.skip_special_tokens,
        structured_outputs=structured,
        logit_bias=params.logit_bias or None,
    )


def check_fan_out(num_prompts: int, n: int, endpoint: Endpoint, settings: Settings) -> None:
    """`--max-n` and `--max-sequences-per-request`, before the prompts are tokenized where
    the body states `n` itself: the work of one request grows with prompts × n, and one
    body must not hold the worker past `--request-timeout` or become millions of requests."""
    if n > settings.max_n:
        raise RequestError(
            f"{endpoint.n_param} is {n}; at most {settings.max_n} samples per prompt are "
            "served (--max-n)",
            param=endpoint.n_param,
            code="integer_above_max_value",
        )
    limit = settings.max_sequences_per_request
    if num_prompts * n > limit:
        param = endpoint.prompt_param if n == 1 else endpoint.n_param
        raise RequestError(
            f"this request asks for {num_prompts * n} sequences (prompts × n); at most "
            f"{limit} are served per request (--max-sequences-per-request)",
            param=param,
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
    """SSE events of one request, those of one output written together (one send, not
    one per event); a failure after the 200 is the endpoint's error events."""
    try:
        async with aclosing(manager.generate(reqs)) as outputs:
            async for out in outputs:
                endpoint.check_output(out)
                if events := endpoint.events(out, acc.add(out), acc):
                    yield "".join(events)
        yield "".join(endpoint.end())
    except RequestError as err:
        yield "".join(endpoint.error(err))


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
        """Adds `out` to its choice; the finished choice when `out` is its last output."""
        self.texts.setdefault(out.index, []).append(out.text)
        ids = self.ids.setdefault(out.index, [])
        del ids[len(ids) - out.rollback :]
        ids.extend(out.output_ids)
        self.logprobs.setdefault(out.index, []).extend(out.logprobs)
        if out.prompt_logprobs:
            self.prompt_logprobs[out.index] = out.prompt_logprobs
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
            prompt_logprobs=self.prompt_logprobs.get(out.index),
        )

    def text(self, index: int) -> str:
        """Choice `index`'s text so far."""
        return "".join(self.texts[index])

    def output_ids(self, index: int) -> list[int]:
        """Choice `index`'s token ids so far."""
        return list(self.ids[index])


def raise_if_aborted(out: ReqOutput, stream: bool) -> None:
    """An aborted OpenAI choice fails the whole request, with the worker's status (400
    when it refused the request, 500 otherwise). One asked for (`/abort_request`) is no
    failure in a stream: it ends with finish reason "abort"."""
    reason = out.finished_reason
    if stream and reason is not None and reason.status_code == REQUESTED_ABORT_STATUS:
        return
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
