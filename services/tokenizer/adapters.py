"""Requests in: API requests to token ids and `SamplingParams`, and every failure on the way
to an OpenAI-style error body.

Nothing here touches a socket or a process, so each bad input the server must answer with
a 4xx is decided, and tested, here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from pydantic import ValidationError

from engine.grammar.limits import GrammarError
from engine.grammar.validate import validate_grammar
from engine.sampling.sampling_params import SamplingParams
from services.tokenizer.openai_api import (
    ChatCompletionMessageParam,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    GenerateRequest,
)

if TYPE_CHECKING:
    from fastapi.exceptions import RequestValidationError
    from transformers import PreTrainedTokenizerBase

_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_INT64 = (-(2**63), 2**63 - 1)
"""msgpack carries 64-bit integers: a larger one could not reach the worker."""
_VALIDATION_CODES = {"missing": "missing_required_parameter", "json_invalid": "invalid_json"}
"""OpenAI-style codes for the pydantic error types that have one of their own."""


class RequestError(Exception):
    """A failure the client should see: what OpenAI's error body needs, never a traceback."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = "invalid_value",
        status: int = 400,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


def error_body(err: RequestError) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`; `type` follows OpenAI's split
    between the client's fault and the server's."""
    kind = "invalid_request_error" if err.status < 500 else "server_error"
    return ErrorResponse(
        error=ErrorInfo(message=err.message, type=kind, param=err.param, code=err.code)
    ).model_dump()


def validation_error_body(exc: ValidationError | RequestValidationError) -> dict[str, Any]:
    """The first validation error as a 400 body naming the field (`messages[0].role`).

    FastAPI's errors are located under `body`; malformed JSON is located at a character
    offset, which names no field.
    """
    error = exc.errors()[0]
    loc = tuple(error["loc"])
    if loc[:1] == ("body",):
        loc = loc[1:]
    param = _dotted(loc) if loc and isinstance(loc[0], str) else None
    cause = (error.get("ctx") or {}).get("error")
    reason = str(cause) if error["type"] == "value_error" and cause is not None else error["msg"]
    code = _VALIDATION_CODES.get(error["type"]) or (
        "invalid_type" if error["type"].endswith("_type") else "invalid_value"
    )
    return error_body(
        RequestError(f"{param}: {reason}" if param else reason, param=param, code=code)
    )


def _dotted(loc: Sequence[str | int]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def check_model(request: ChatCompletionRequest | CompletionRequest, served_model: str) -> None:
    """A request for another model is an error rather than silently served by this one;
    omitting `model` means this one."""
    if request.model is not None and request.model != served_model:
        raise RequestError(
            f"the model {request.model!r} does not exist; this server serves {served_model!r}",
            param="model",
            code="model_not_found",
            status=404,
        )


def to_sampling_params(
    request: ChatCompletionRequest | CompletionRequest | GenerateRequest,
    prompt_len: int,
    *,
    max_tokens_cap: int,
    context_len: int,
    vocab_size: int,
    grammar_max_bytes: int,
    grammar_max_nesting_depth: int,
) -> SamplingParams:
    """Map a request onto the engine's `SamplingParams` and check it, for a prompt of
    `prompt_len` tokens (one call per prompt of a batch: each has its own room).

    `max_new_tokens`: a request that cannot fit the context is an error (asking for more
    than the model can hold is the client's mistake); the server's `max_tokens_cap` is
    policy, so a larger request is clamped to it and ends with finish_reason "length".
    Omitted, it is the room left in the context (OpenAI's default; /generate keeps the
    engine's default of 128, as SGLang does), up to the cap. Ranges are
    `SamplingParams.verify`'s; its errors come back under the request's own field names.
    A grammar (json_schema, regex, ebnf, response_format) is checked against the limits
    and parsed here, so that a bad one is a 400 before the request is queued.
    """
    prompt_param: str
    if isinstance(request, GenerateRequest):
        names, kwargs, requested = _native_kwargs(request)
        prefix, prompt_param = "sampling_params.", request.prompt_field
        default = SamplingParams.max_new_tokens
    else:
        names, kwargs, requested = _openai_kwargs(request)
        prefix, prompt_param = (
            "",
            "messages" if isinstance(request, ChatCompletionRequest) else "prompt",
        )
        default = context_len
    kwargs["max_new_tokens"] = _max_new_tokens(
        requested,
        names.get("max_new_tokens", prefix + "max_new_tokens"),
        prompt_len,
        prompt_param,
        default=default,
        max_tokens_cap=max_tokens_cap,
        context_len=context_len,
    )
    try:
        params = SamplingParams.from_dict(kwargs)
        params.verify(vocab_size)
        _check_int64(params)
    except ValueError as exc:
        raise _renamed(str(exc), names, prefix) from None
    if params.grammar is not None:
        kind, source = params.grammar
        try:
            validate_grammar(kind, source, grammar_max_bytes, grammar_max_nesting_depth)
        except GrammarError as exc:
            param = names.get(kind, prefix + kind)
            raise RequestError(str(exc).replace(kind, param, 1), param=param) from None
    return params


def _check_int64(params: SamplingParams) -> None:
    for f in fields(params):
        value = getattr(params, f.name)
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and not _INT64[0] <= value <= _INT64[1]
        ):
            raise ValueError(f"{f.name} must be in [{_INT64[0]}, {_INT64[1]}], got {value}")


def _openai_kwargs(
    request: ChatCompletionRequest | CompletionRequest,
) -> tuple[dict[str, str], dict[str, Any], int | None]:
    """The request's name for each native field it renames, the native kwargs (unset fields
    left to SamplingParams' defaults) and the requested max tokens."""
    names = {"min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens"}
    kwargs: dict[str, Any] = {
        "min_new_tokens": request.min_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "frequency_penalty": request.frequency_penalty,
        "presence_penalty": request.presence_penalty,
        "repetition_penalty": request.repetition_penalty,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos,
        "skip_special_tokens": request.skip_special_tokens,
        "logit_bias": request.logit_bias,
        "seed": request.seed,
        "n": request.n,
        "regex": request.regex,
        "ebnf": request.ebnf,
    }
    if request.response_format is not None:
        kwargs["json_schema"] = request.response_format.grammar_schema()
        names["json_schema"] = "response_format"
    requested = request.max_tokens
    if isinstance(request, ChatCompletionRequest):
        kwargs.update(logprobs=request.logprobs, top_logprobs_num=request.top_logprobs)
        names["top_logprobs_num"] = "top_logprobs"
        if request.max_completion_tokens is not None:
            names["max_new_tokens"], requested = (
                "max_completion_tokens",
                request.max_completion_tokens,
            )
    else:
        kwargs.update(logprobs=request.logprobs is not None, top_logprobs_num=request.logprobs)
        names["top_logprobs_num"] = "logprobs"
    return names, {k: v for k, v in kwargs.items() if v is not None}, requested


def _native_kwargs(request: GenerateRequest) -> tuple[dict[str, str], dict[str, Any], object]:
    """Like `_openai_kwargs`; SGLang asks for logprobs beside `sampling_params`, not in it."""
    names: dict[str, str] = {}
    kwargs = dict(request.sampling_params)
    if request.return_logprob:
        kwargs["logprobs"], names["logprobs"] = True, "return_logprob"
    if request.top_logprobs_num:
        kwargs["top_logprobs_num"], names["top_logprobs_num"] = (
            request.top_logprobs_num,
            "top_logprobs_num",
        )
    return names, kwargs, kwargs.pop("max_new_tokens", None)


def _max_new_tokens(
    requested: object,
    param: str,
    prompt_len: int,
    prompt_param: str,
    *,
    default: int,
    max_tokens_cap: int,
    context_len: int,
) -> object:
    room = context_len - prompt_len
    if room <= 0:
        raise RequestError(
            f"the prompt is {prompt_len} tokens, but this model's context is {context_len} tokens: "
            "no room is left to generate",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return min(default, room, max_tokens_cap)
    if not isinstance(requested, int) or isinstance(requested, bool):
        return requested  # SamplingParams.verify names the type error
    if requested < 1:
        # The engine samples a token from the prefill, so it cannot honour 0.
        raise RequestError(f"{param} must be at least 1, got {requested}", param=param)
    if requested > room:
        raise RequestError(
            f"this model's context is {context_len} tokens; the prompt takes {prompt_len}, "
            f"leaving {room} for the completion, but {param} is {requested}",
            param=param,
            code="context_length_exceeded",
        )
    return min(requested, max_tokens_cap)


def _renamed(message: str, names: dict[str, str], prefix: str) -> RequestError:
    """A `SamplingParams` error in the vocabulary of the request that caused it: renamed
    fields take the request's names, the others are found under `prefix`."""
    field = message.split(" ", 1)[0]
    param: str | None
    if field in _SAMPLING_FIELDS:
        param = names.get(field, prefix + field)
    else:
        param = prefix.rstrip(".") or None
    if names:
        pattern = r"\b(" + "|".join(map(re.escape, names)) + r")\b"
        message = re.sub(pattern, lambda m: names[m.group(1)], message)
    return RequestError(message, param=param)


def tokenize_prompts(
    request: CompletionRequest | GenerateRequest,
    tokenizer: PreTrainedTokenizerBase | None,
    vocab_size: int,
) -> list[list[int]]:
    """Token ids for each prompt of the batch; ids sent by the client must exist in the
    vocabulary, since an out-of-range id would index past the embedding table."""
    if isinstance(request, CompletionRequest):
        prompts, param = request.prompt, "prompt"
    else:
        prompts, param = request.prompts, request.prompt_field
    if isinstance(prompts[0], str):
        if tokenizer is None:
            raise RequestError(
                "text prompts need a tokenizer; this server was started without one", param=param
            )
        return [tokenizer.encode(text) for text in prompts]
    for i, ids in enumerate(prompts):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            message = f"token id {bad} in {param}[{i}] is outside the vocabulary [0, {vocab_size})"
            raise RequestError(message, param=param)
    return [list(ids) for ids in prompts]


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[ChatCompletionMessageParam]
) -> list[int]:
    """The prompt ids of a conversation, by the model's own chat template, ending with the
    assistant's generation prompt.

    The template is rendered to text and then encoded without special tokens added, because
    templates that start with a BOS token write it into the text themselves.
    """
    conversation = [{"role": m.role, "content": m.content or ""} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
    except (TemplateError, ValueError) as exc:
        raise RequestError(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from None
    return tokenizer.encode(text, add_special_tokens=False)
