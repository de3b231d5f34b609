"""Requests in: an API request's prompts to token ids and its fields to the engine's
`SamplingParams`, each bad input refused as a `RequestError` naming the field.

Nothing here touches a socket or a process, so each bad input the server must answer with
a 4xx is decided, and tested, here.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Protocol

from engine.grammar.limits import GrammarError
from engine.grammar.validate import validate_grammar
from engine.sampling.sampling_params import GRAMMAR_KINDS, SamplingParams
from engine.sched.request_limits import logprob_start_error, prompt_length_error
from services.tokenizer.errors import RequestError
from services.tokenizer.parsers import named_tool_schema, required_tools_schema, tool_specs
from services.tokenizer.protocol.chat import (
    ChatCompletionMessageParam,
    ChatCompletionRequest,
    NamedToolChoice,
)
from services.tokenizer.protocol.completions import CompletionRequest
from services.tokenizer.protocol.native import GenerateRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_INT64 = (-(2**63), 2**63 - 1)
"""msgpack carries 64-bit integers: a larger one could not reach the worker."""
COMPLETIONS_MAX_LOGPROBS = 5
"""OpenAI's limit on the legacy completions' `logprobs` (chat's `top_logprobs` goes to 20)."""
GenerationBody = ChatCompletionRequest | CompletionRequest | GenerateRequest
"""A request to a generation endpoint (the Responses API's becomes a chat request)."""


class RequestLimits(Protocol):
    """The size limits a request is held to, each a flag of its own (`Settings` has them):
    what a request may make the worker copy into every step's output batch and the
    tokenizer decode per token."""

    max_stop_strings: int
    max_stop_string_length: int
    max_stop_token_ids: int
    max_logit_bias: int
    max_top_logprobs: int


def check_request(
    request: GenerationBody, served_model: str, lora_adapters: Collection[str]
) -> str | None:
    """What is refused before the server's readiness is even looked at, per API; the LoRA
    adapter the request names (None: the base model). The native API names no model, only
    an adapter (`lora_path`)."""
    if isinstance(request, GenerateRequest):
        return check_model(request.lora_path, served_model, lora_adapters, "lora_path")
    lora_name = check_model(request.model, served_model, lora_adapters)
    if isinstance(request, ChatCompletionRequest):
        check_chat_request(request)
    else:
        check_completion_request(request)
    return lora_name


def prompt_chars(request: GenerationBody) -> int:
    """The characters of prompt text a request sends, for `--max-prompt-chars`: a
    conversation's, or a batch's text prompts' (token ids count none; the caller writes
    their markup, so their special tokens are parsed, as OpenAI's completions do)."""
    if isinstance(request, ChatCompletionRequest):
        return chat_prompt_chars(request.messages)
    prompts = request.prompt if isinstance(request, CompletionRequest) else request.prompts
    return sum(len(p) for p in prompts if isinstance(p, str))


def chat_prompt_chars(messages: Sequence[ChatCompletionMessageParam]) -> int:
    """The characters of a conversation's text: its contents and earlier calls' arguments."""
    return sum(
        len(m.content or "") + sum(len(c.function.arguments) for c in m.tool_calls or ())
        for m in messages
    )


def check_model(
    requested: str | None,
    served_model: str,
    lora_adapters: Collection[str] = (),
    param: str = "model",
) -> str | None:
    """The LoRA adapter `requested` names (None: the base model, also when `model` is
    omitted). A request for another model is an error rather than silently served by this
    one."""
    if requested is None or requested == served_model:
        return None
    if requested in lora_adapters:
        return requested
    served = ", ".join(repr(m) for m in (served_model, *lora_adapters))
    raise RequestError(
        f"the model {requested!r} does not exist; this server serves {served}",
        param=param,
        code="model_not_found",
        status=404,
    )


def check_chat_request(request: ChatCompletionRequest) -> None:
    """What the chat fields say together: a forced tool must be one of the tools, and a
    continued final message opens no new turn."""
    names = [t.function.name for t in request.tools or ()]
    if len(set(names)) != len(names):
        raise RequestError("tools: two tools have the same name", param="tools")
    choice = request.tool_choice
    if choice == "required" and not names:
        raise RequestError('tool_choice "required" needs tools', param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise RequestError(
            f"tool_choice names the function {choice.function.name!r}, which is not among "
            f"the tools {names}",
            param="tool_choice",
        )
    check_continuation(request.add_generation_prompt, request.continue_final_message)


def check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """A continued final message opens no new turn (chat and `/tokenize` alike)."""
    if continue_final_message and add_generation_prompt:
        raise RequestError(
            "continue_final_message needs add_generation_prompt: false",
            param="continue_final_message",
        )


def check_completion_request(request: CompletionRequest) -> None:
    """Prompt logprobs are computed by each request's own prefill: refused where that
    would repeat a prompt's prefill per sample, and not streamed."""
    wants_prompt_logprobs = request.prompt_logprobs is not None or (
        request.echo and request.logprobs is not None
    )
    if wants_prompt_logprobs and request.n > 1:
        raise RequestError(
            "prompt logprobs (echo with logprobs, or prompt_logprobs) are served with n: 1 only",
            param="n",
        )
    if request.prompt_logprobs is not None and request.stream:
        raise RequestError(
            "prompt_logprobs are not streamed; send stream: false (or echo with logprobs)",
            param="prompt_logprobs",
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
    limits: RequestLimits,
    grammar_backend: str = "auto",
) -> SamplingParams:
    """Map a request onto the engine's `SamplingParams` and check it, for a prompt of
    `prompt_len` tokens (one call per prompt of a batch: each has its own room).

    `max_new_tokens`: a request that cannot fit the context is an error (asking for more
    than the model can hold is the client's mistake); the server's `max_tokens_cap` is
    policy, so a larger request is clamped to it and ends with finish_reason "length".
    Omitted, it is the room left in the context (OpenAI's default; /generate keeps the
    engine's default of 128, as SGLang does), up to the cap. Sizes are the server's
    `limits` (a 400 naming the field, the limit and its flag), ranges are
    `SamplingParams.verify`'s; its errors come back under the request's own field names.
    A grammar (json_schema, regex, ebnf, response_format) is checked against the limits
    and parsed here, so that a bad one is a 400 before the request is queued.
    """
    prompt_param: str
    if isinstance(request, GenerateRequest):
        names, kwargs, requested = _native_kwargs(request)
        prefix, prompt_param = "sampling_params.", request.prompt_field
        default = SamplingParams.max_new_tokens
        allow_zero = True
    else:
        names, kwargs, requested = _openai_kwargs(request)
        prefix, prompt_param = (
            "",
            "messages" if isinstance(request, ChatCompletionRequest) else "prompt",
        )
        default = context_len
        allow_zero = isinstance(request, CompletionRequest) and request.echo
    kwargs["max_new_tokens"] = _max_new_tokens(
        requested,
        names.get("max_new_tokens", prefix + "max_new_tokens"),
        prompt_len,
        prompt_param,
        default=default,
        allow_zero=allow_zero,
        max_tokens_cap=max_tokens_cap,
        context_len=context_len,
    )
    try:
        params = SamplingParams.from_dict(kwargs)
    except ValueError as exc:
        raise _renamed(str(exc), names, prefix) from None

    def param_of(field: str) -> str:
        return names.get(field, prefix + field)

    _check_sizes(params, limits, param_of, completions=isinstance(request, CompletionRequest))
    try:
        params.verify(vocab_size)
        _check_int64(params)
    except ValueError as exc:
        raise _renamed(str(exc), names, prefix) from None
    param = param_of("logprob_start_len")
    if (error := logprob_start_error(params.logprob_start_len, prompt_len, param)) is not None:
        raise RequestError(error, param=param)
    if params.grammar is not None:
        _check_grammar(
            params.grammar,
            param_of,
            grammar_max_bytes,
            grammar_max_nesting_depth,
            best_effort=request.json_schema_best_effort,
            backend=grammar_backend,
        )
    return params


def _check_grammar(
    grammar: tuple[str, str],
    param_of: Callable[[str], str],
    max_bytes: int,
    max_nesting_depth: int,
    best_effort: bool,
    backend: str,
) -> None:
    """The grammar checked against the limits and parsed by the library that will serve it
    (`--grammar-backend`), so that a bad one is a 400 naming the request's field before the
    request is queued."""
    kind, source = grammar
    if backend == "none":
        return  # refused as a whole where the request reaches the worker
    try:
        validate_grammar(
            kind, source, max_bytes, max_nesting_depth, best_effort=best_effort, backend=backend
        )
    except GrammarError as exc:
        param = param_of(kind)
        raise RequestError(str(exc).replace(kind, param, 1), param=param) from None


def _check_sizes(
    params: SamplingParams,
    limits: RequestLimits,
    param_of: Callable[[str], str],
    completions: bool,
) -> None:
    """The server's size limits, before `verify` walks the values. Values of the wrong type
    are left to `verify`, which names the type error."""
    _check_length(param_of("stop"), params.stop, limits.max_stop_strings, "max_stop_strings")
    if isinstance(params.stop, list):
        longest = max((s for s in params.stop if isinstance(s, str)), key=len, default="")
        if len(longest) > limits.max_stop_string_length:
            param = param_of("stop")
            raise RequestError(
                f"{param} has a string of {len(longest)} characters; at most "
                f"{limits.max_stop_string_length} are allowed ({_flag('max_stop_string_length')})",
                param=param,
                code="string_above_max_length",
            )
    _check_length(
        param_of("stop_token_ids"),
        params.stop_token_ids,
        limits.max_stop_token_ids,
        "max_stop_token_ids",
    )
    _check_length(
        param_of("logit_bias"), params.logit_bias, limits.max_logit_bias, "max_logit_bias"
    )
    top_limit, top_reason = limits.max_top_logprobs, _flag("max_top_logprobs")
    if completions and COMPLETIONS_MAX_LOGPROBS < top_limit:
        top_limit, top_reason = COMPLETIONS_MAX_LOGPROBS, "OpenAI's limit for completions"
    _check_at_most(param_of("top_logprobs_num"), params.top_logprobs_num, top_limit, top_reason)
    _check_at_most(
        param_of("prompt_top_logprobs_num"),
        params.prompt_top_logprobs_num,
        limits.max_top_logprobs,
        _flag("max_top_logprobs"),
    )


def _flag(setting: str) -> str:
    """The command-line flag of a `Settings` field."""
    return "--" + setting.replace("_", "-")


def _check_length(param: str, value: object, limit: int, setting: str) -> None:
    if isinstance(value, (list, dict)) and len(value) > limit:
        raise RequestError(
            f"{param} has {len(value)} entries; at most {limit} are allowed ({_flag(setting)})",
            param=param,
            code="array_above_max_length",
        )


def _check_at_most(param: str, value: object, limit: int, reason: str) -> None:
    if isinstance(value, int) and value > limit:
        raise RequestError(
            f"{param} is {value}; at most {limit} are allowed ({reason})",
            param=param,
            code="integer_above_max_value",
        )


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
        forced = _forced_tools_schema(request)
        if forced is not None:
            given = [k for k in GRAMMAR_KINDS if kwargs.get(k) is not None]
            if given:
                raise RequestError(
                    f"tool_choice forces the output to be tool calls; it cannot also be "
                    f"constrained by {names.get(given[0], given[0])}",
                    param="tool_choice",
                )
            kwargs["json_schema"], names["json_schema"] = forced, "tool_choice"
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
        if request.echo and request.logprobs is not None:
            kwargs.update(logprob_start_len=0, prompt_top_logprobs_num=request.logprobs)
            names["prompt_top_logprobs_num"] = "logprobs"
        if request.prompt_logprobs is not None:
            kwargs.update(logprob_start_len=0, prompt_top_logprobs_num=request.prompt_logprobs)
            names["prompt_top_logprobs_num"] = "prompt_logprobs"
    grammar = _structured_outputs_grammar(request)
    if grammar is not None:
        kwargs[grammar[0]] = grammar[1]
        names[grammar[0]] = "structured_outputs"
    return names, {k: v for k, v in kwargs.items() if v is not None}, requested


def _forced_tools_schema(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema of the calls a forced tool choice demands: a named function's
    arguments object, or for "required" a list of `{"name", "parameters"}` items."""
    choice = request.effective_tool_choice
    if not isinstance(choice, NamedToolChoice) and choice != "required":
        return None
    specs = tool_specs([t.model_dump() for t in request.tools or ()])
    if isinstance(choice, NamedToolChoice):
        return named_tool_schema(next(s for s in specs if s.name == choice.function.name))
    return required_tools_schema(specs, request.parallel_tool_calls)


def _structured_outputs_grammar(
    request: ChatCompletionRequest | CompletionRequest,
) -> tuple[str, str | dict[str, Any]] | None:
    if request.structured_outputs is None:
        return None
    kind, source = request.structured_outputs.as_grammar()
    if kind in ("regex", "ebnf") and getattr(request, kind) is not None:
        raise RequestError(f"give one of structured_outputs and {kind}", param="structured_outputs")
    return kind, source


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
    if request.return_logprob and request.logprob_start_len != -1:
        kwargs["logprob_start_len"], names["logprob_start_len"] = (
            request.logprob_start_len,
            "logprob_start_len",
        )
        kwargs["prompt_top_logprobs_num"] = request.top_logprobs_num
        names["prompt_top_logprobs_num"] = "top_logprobs_num"
    return names, kwargs, kwargs.pop("max_new_tokens", None)


def _max_new_tokens(
    requested: object,
    param: str,
    prompt_len: int,
    prompt_param: str,
    *,
    default: int,
    allow_zero: bool,
    max_tokens_cap: int,
    context_len: int,
) -> object:
    if (error := prompt_length_error(prompt_len, context_len)) is not None:
        raise RequestError(error, param=prompt_param, code="context_length_exceeded")
    room = context_len - prompt_len
    if requested is None:
        return min(default, room, max_tokens_cap)
    if not isinstance(requested, int) or isinstance(requested, bool):
        return requested  # SamplingParams.verify names the type error
    if requested < (0 if allow_zero else 1):
        only = (
            " (0 asks for the prompt's logprobs alone: send it with echo)" if requested == 0 else ""
        )
        raise RequestError(f"{param} must be at least 1, got {requested}{only}", param=param)
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


_SPECIAL_TOKENS_PROBE = "radixserve"


def with_special_tokens(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    """`ids` with the special tokens the tokenizer adds around one sequence (a BOS, an EOS),
    as `tokenizer(text, add_special_tokens=True)` would add them to the text of `ids`."""
    before, after = _special_tokens_around(tokenizer)
    return [*before, *ids, *after]


@functools.lru_cache(maxsize=8)
def _special_tokens_around(
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Read off one encoding with and without special tokens, so that it holds for any
    post-processor and any transformers version (transformers 5 dropped
    `build_inputs_with_special_tokens` from its tokenizers)."""
    plain = tokenizer.encode(_SPECIAL_TOKENS_PROBE, add_special_tokens=False)
    full = tokenizer.encode(_SPECIAL_TOKENS_PROBE, add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return tuple(full[:start]), tuple(full[start + len(plain) :])
    raise ValueError(
        f"{type(tokenizer).__name__} changes a text's own ids when it adds special tokens"
    )
