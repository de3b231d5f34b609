"""The HTTP endpoints (docs/api.md). Each handler finds the manager and the settings in
the app's state (`serving_base.AppState`); the generation endpoints are one flow,
`serving_base.serve`, with an `Endpoint` each, and the render endpoints stop that flow
before submission (`serving_render.render`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from contextlib import aclosing
from typing import Any

import pydantic_core
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from engine.sampling.sampling_params import SamplingParams
from services.io_struct import LoRAAdapterReqOutput, TokenizedGenerateReqInput
from services.settings import LAUNCH_ID_HEADER
from services.tokenizer.chat_template import render_chat
from services.tokenizer.errors import RequestError, error_body
from services.tokenizer.manager import unavailable
from services.tokenizer.middleware import require_admin
from services.tokenizer.openapi import ERROR_RESPONSES, answers, request_body
from services.tokenizer.protocol.chat import ChatCompletionRequest, ChatCompletionResponse
from services.tokenizer.protocol.common import LoRAModelCard, ModelCard, ModelList
from services.tokenizer.protocol.completions import CompletionRequest, CompletionResponse
from services.tokenizer.protocol.native import (
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from services.tokenizer.protocol.responses import ResponsesRequest
from services.tokenizer.request_mapper import (
    chat_prompt_chars,
    check_continuation,
    check_model,
    with_special_tokens,
)
from services.tokenizer.serving_base import (
    INLINE_BODY_BYTES,
    AppState,
    app_state,
    check_prompt_chars,
    json_body,
    off_loop,
    parse_body,
    serve,
)
from services.tokenizer.serving_chat import ChatEndpoint
from services.tokenizer.serving_completions import CompletionsEndpoint
from services.tokenizer.serving_generate import GenerateEndpoint
from services.tokenizer.serving_render import render
from services.tokenizer.serving_responses import ResponsesEndpoint, responses_error

HEALTH_GENERATE_TIMEOUT_S = 20.0
SECRET_SETTINGS = ("api_key", "admin_api_key")
"""Settings `/get_server_info` never shows."""

router = APIRouter(responses=ERROR_RESPONSES)


class AbortRequestInput(BaseModel):
    """SGLang's `/abort_request`: one rid (an OpenAI response id aborts all its choices)."""

    model_config = ConfigDict(
        strict=True,
        extra="ignore",
        json_schema_extra={
            "anyOf": [
                {"required": ["rid"], "properties": {"rid": {"minLength": 1}}},
                {"required": ["abort_all"], "properties": {"abort_all": {"const": True}}},
            ]
        },
    )
    rid: str = ""
    abort_all: bool = False


@router.post(
    "/v1/chat/completions",
    openapi_extra=request_body(ChatCompletionRequest),
    responses=answers(ChatCompletionResponse, "A chat completion, or its chunks as events"),
)
async def chat_completions(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    return await serve(request, ChatEndpoint(body, app_state(request).model))


@router.post(
    "/v1/completions",
    openapi_extra=request_body(CompletionRequest),
    responses=answers(CompletionResponse, "A completion, or its chunks as events"),
)
async def completions(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    return await serve(request, CompletionsEndpoint(body, app_state(request).model))


@router.post("/v1/chat/completions/render", openapi_extra=request_body(ChatCompletionRequest))
async def chat_completions_render(request: Request) -> dict[str, Any]:
    """vLLM's chat render: the ids chat would send the worker (template, tools and reasoning
    as chat applies them) and their sampling parameters; nothing reaches the worker."""
    body = await parse_body(request, ChatCompletionRequest)
    (rendered,) = await render(request, ChatEndpoint(body, app_state(request).model))
    return rendered.model_dump()


@router.post("/v1/completions/render", openapi_extra=request_body(CompletionRequest))
async def completions_render(request: Request) -> list[dict[str, Any]]:
    """vLLM's completions render: one rendered request per prompt of the batch."""
    body = await parse_body(request, CompletionRequest)
    endpoint = CompletionsEndpoint(body, app_state(request).model)
    return [r.model_dump() for r in await render(request, endpoint)]


@router.post(
    "/v1/responses",
    openapi_extra=request_body(ResponsesRequest),
    responses=answers(None, "A Response, or its events"),
)
async def responses(request: Request) -> Response:
    body = await parse_body(request, ResponsesRequest)
    try:
        return await serve(request, ResponsesEndpoint(body, app_state(request).model))
    except RequestError as err:
        raise responses_error(err) from None


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return _model_list(app_state(request)).model_dump()


@router.get("/v1/models/{model_id:path}")
async def model_card(request: Request, model_id: str) -> dict[str, Any]:
    state = app_state(request)
    check_model(model_id, state.model, state.manager.lora_adapters)
    card = next(card for card in _model_list(state).data if card.id == model_id)
    return card.model_dump()


def _model_list(state: AppState) -> ModelList:
    info = state.manager.worker_info
    context_length = None if info is None else info.context_length
    return model_list(state.model, context_length, state.started, state.manager.lora_adapters)


def model_list(
    model: str, max_model_len: int | None, created: int, lora_adapters: Iterable[str] = ()
) -> ModelList:
    """The base model, then each LoRA adapter with the base model as its parent."""
    base = ModelCard(id=model, created=created, max_model_len=max_model_len)
    cards = [
        LoRAModelCard(id=name, created=created, max_model_len=max_model_len, parent=model)
        for name in lora_adapters
    ]
    return ModelList(data=[base, *cards])


class LoadLoRAAdapterInput(BaseModel):
    """SGLang's `/load_lora_adapter` (vLLM's `/v1/load_lora_adapter` has the same fields)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str = Field(json_schema_extra={"minLength": 1})
    lora_path: str


class UnloadLoRAAdapterInput(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str


@router.post("/load_lora_adapter", openapi_extra=request_body(LoadLoRAAdapterInput))
@router.post("/v1/load_lora_adapter", openapi_extra=request_body(LoadLoRAAdapterInput))
async def load_lora_adapter(request: Request) -> dict[str, Any]:
    """Load a PEFT adapter at run time (`--enable-lora-runtime-update`, an operator's); a
    400 for a bad adapter or path, leaving what serves untouched."""
    require_admin(request, "/load_lora_adapter")
    state = app_state(request)
    body = await parse_body(request, LoadLoRAAdapterInput)
    _check_adapter_name(state, body.lora_name)
    reply = await state.manager.load_lora_adapter(body.lora_name, body.lora_path)
    return _lora_answer(reply)


@router.post("/unload_lora_adapter", openapi_extra=request_body(UnloadLoRAAdapterInput))
@router.post("/v1/unload_lora_adapter", openapi_extra=request_body(UnloadLoRAAdapterInput))
async def unload_lora_adapter(request: Request) -> dict[str, Any]:
    """Unload an adapter; a 409 while requests use it, a 404 for one not loaded."""
    require_admin(request, "/unload_lora_adapter")
    state = app_state(request)
    body = await parse_body(request, UnloadLoRAAdapterInput)
    reply = await state.manager.unload_lora_adapter(body.lora_name)
    return _lora_answer(reply)


def _check_adapter_name(state: AppState, lora_name: str) -> None:
    """An adapter cannot take the base model's name, which means no adapter. The worker
    checks the rest (run-time updates allowed, the path, the adapter itself)."""
    if lora_name == state.model or not lora_name:
        raise RequestError(
            f"{lora_name!r} cannot name a LoRA adapter: it is empty or the base model's name",
            param="lora_name",
        )


def _lora_answer(reply: LoRAAdapterReqOutput) -> dict[str, Any]:
    """The worker's refusal as an error (400 bad adapter, 404 unknown, 409 in use), else
    SGLang's answer."""
    if not reply.success:
        code = {404: "model_not_found", 409: "lora_adapter_in_use"}.get(reply.status)
        raise RequestError(
            reply.message, param=reply.param, code=code or "invalid_value", status=reply.status
        )
    return {"success": True, "message": reply.message}


TOKENIZE_BODY = request_body(TokenizeCompletionRequest, TokenizeChatRequest)
"""A conversation when the body has `messages`, else a prompt."""


@router.post("/tokenize", openapi_extra=TOKENIZE_BODY)
@router.post("/v1/tokenize", openapi_extra=TOKENIZE_BODY)
async def tokenize(request: Request) -> dict[str, Any]:
    """vLLM's `/tokenize`: a prompt's ids, or a conversation's as chat would send them."""
    state = app_state(request)
    raw = await json_body(request)
    try:
        data = pydantic_core.from_json(raw)
    except ValueError:
        data = None  # not JSON: the model's validation names the fault
    chat = isinstance(data, dict) and "messages" in data
    body: TokenizeChatRequest | TokenizeCompletionRequest = (
        TokenizeChatRequest.model_validate_json(raw)
        if chat
        else TokenizeCompletionRequest.model_validate_json(raw)
    )
    check_model(body.model, state.model, state.manager.lora_adapters)
    if isinstance(body, TokenizeChatRequest):
        check_continuation(body.add_generation_prompt, body.continue_final_message)
    param = "messages" if chat else "prompt"
    tokenizer = state.require_tokenizer(param)
    chars = (
        chat_prompt_chars(body.messages)
        if isinstance(body, TokenizeChatRequest)
        else len(body.prompt)
    )
    check_prompt_chars(chars, state.settings.max_prompt_chars, param)

    def token_ids() -> list[int]:
        """As chat and completions tokenize; `add_special_tokens` on a conversation adds
        the tokenizer's own (a BOS) on top of what the template wrote, as vLLM's does."""
        if isinstance(body, TokenizeChatRequest):
            ids = render_chat(
                tokenizer,
                body.messages,
                tools=body.tools,
                template_kwargs=body.chat_template_kwargs,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                special_tokens_in_content=state.settings.allow_special_tokens_in_content,
            ).ids
            return with_special_tokens(tokenizer, ids) if body.add_special_tokens else ids
        return list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))

    ids = await off_loop(token_ids, inline=len(raw) <= INLINE_BODY_BYTES)
    info = state.manager.require_ready()
    strs = list(tokenizer.convert_ids_to_tokens(ids)) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=info.context_length, tokens=ids, token_strs=strs
    ).model_dump()


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
@router.post("/v1/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize(request: Request) -> dict[str, Any]:
    state = app_state(request)
    body = await parse_body(request, DetokenizeRequest)
    check_model(body.model, state.model, state.manager.lora_adapters)
    tokenizer = state.require_tokenizer("tokens")
    info = state.manager.require_ready()
    bad = next((t for t in body.tokens if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"token id {bad} is outside the vocabulary [0, {info.vocab_size})", param="tokens"
        )
    text = tokenizer.decode(body.tokens)
    assert isinstance(text, str), "one id list decodes to one text"
    return DetokenizeResponse(prompt=text).model_dump()


@router.get("/tokenizer_info")
@router.get("/v1/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """vLLM's `/tokenizer_info`: what a client needs to tokenize as the server does (its
    special tokens and chat template); lm-eval's remote tokenizer reads it."""
    tokenizer = app_state(request).require_tokenizer(None)
    template = tokenizer.chat_template
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "model_max_length": app_state(request).manager.require_ready().context_length,
        "vocab_size": len(tokenizer),
        "chat_template": template if isinstance(template, str) else None,
    }


@router.post(
    "/generate",
    openapi_extra=request_body(GenerateRequest),
    responses=answers(None, "One answer (a list for a batch), or each prompt's progress as events"),
)
async def generate(request: Request) -> Response:
    body = await parse_body(request, GenerateRequest)
    return await serve(request, GenerateEndpoint(body, app_state(request).model))


@router.get("/health", response_class=Response)
async def health(request: Request) -> Response:
    state = app_state(request)
    try:
        state.manager.require_ready()
    except RequestError as err:
        return JSONResponse(error_body(err), err.status)
    launch_id = state.settings.launch_id  # `radixserve serve` knows its own server by it
    return Response(status_code=200, headers={LAUNCH_ID_HEADER: launch_id} if launch_id else None)


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus_metrics(request: Request) -> Response:
    """The tokenizer's series and the worker's (`worker_metrics_proxy`), so that a scraper
    of the API port alone sees the queue and KV gauges. The worker is asked first, so a
    failed try is already counted in the tokenizer's series that answer it."""
    state = app_state(request)
    worker = await state.worker_metrics.scrape()
    own = generate_latest(state.registry)
    return Response(state.worker_metrics.merged(own, worker), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz", response_class=Response)
async def healthz() -> Response:
    """Liveness of this process alone: a dead peer must not get it restarted too."""
    return Response(status_code=200)


@router.get("/health_generate", response_class=Response)
async def health_generate(request: Request) -> Response:
    """Readiness proven end to end: one token through worker and detokenizer."""
    manager = app_state(request).manager
    info = manager.require_ready()
    probe = TokenizedGenerateReqInput(
        rid=manager.new_rid("health"),
        input_ids=[info.eos_token_ids[0] if info.eos_token_ids else 0],
        sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
    )

    async def run() -> None:
        async with aclosing(manager.generate([probe], observed=False)) as outputs:
            async for _ in outputs:
                pass

    try:
        await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        raise unavailable(f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s") from None
    return Response(status_code=200)


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    state = app_state(request)
    info = state.manager.require_ready()
    return {
        "model_path": state.settings.model,
        "tokenizer_path": state.settings.tokenizer or state.settings.model,
        "served_model_name": state.settings.served_model_name,
        "is_generation": True,
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "max_total_tokens": info.max_total_tokens,
        "eos_token_ids": info.eos_token_ids,
    }


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    """The settings (never a key) and the worker's live state; the worker's values win
    where both have one (the KV size it actually allocated).
    `?check_integrity=true` adds `radix_integrity` ("ok", "failed: ...", or "skipped"
    while requests run): the radix tree's full check, a debugging aid for operators only
    (it walks the whole tree in the worker's loop)."""
    state = app_state(request)
    check = request.query_params.get("check_integrity", "").lower() in ("1", "true", "yes")
    if check:
        require_admin(request, "check_integrity")
    settings = {
        k: v for k, v in dataclasses.asdict(state.settings).items() if k not in SECRET_SETTINGS
    }
    info = await state.manager.server_info(check_integrity=check)
    return {
        **settings,
        **info,
        "num_in_flight_requests": state.manager.num_in_flight(),
        "num_queued_requests": state.manager.num_queued,
    }


@router.post("/flush_cache")
async def flush_cache(request: Request) -> Response:
    require_admin(request, "/flush_cache")
    reply = await app_state(request).manager.flush_cache()
    if not reply.success:
        raise RequestError(reply.message, code="requests_in_flight", status=409)
    return JSONResponse({"message": reply.message})


@router.post("/abort_request", openapi_extra=request_body(AbortRequestInput))
async def abort_request(request: Request) -> dict[str, int]:
    """One request (any API key: its id is unguessable), or every one (`abort_all`: an
    operator's). The aborted request ends with finish reason "abort" (a stream) or a 499
    (an answer not streamed)."""
    body = await parse_body(request, AbortRequestInput)
    if not body.rid and not body.abort_all:
        raise RequestError("give a rid, or abort_all: true", param="rid")
    if body.abort_all:
        require_admin(request, "abort_all")
    return {"aborted": app_state(request).manager.abort("" if body.abort_all else body.rid)}
