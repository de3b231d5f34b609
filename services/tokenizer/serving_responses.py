"""`/v1/responses`, OpenAI's Responses API, as a translation over chat completions: the
request becomes a chat body, the chat answer becomes a Response and the chat stream's
typed chunks become Responses events (`ResponsesEndpoint`, served by the chat flow).

The server is stateless: nothing is stored, so `previous_response_id` and `conversation`
are refused and a client sends the whole conversation in `input` every time. Fields follow
chat's three kinds: some are ignored on purpose (`user`, `store`, `service_tier`...), a
field of OpenAI's that is not served is refused unless sent at its default (a client that
asks for `background` or `include` relies on getting it), and a field never heard of is
ignored. Every refusal is a `RequestError` naming the field (`tools[1].type`).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, cast, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from services.tokenizer.chat_output import ChatParsers
from services.tokenizer.choice_output import ChoiceOutput
from services.tokenizer.errors import RequestError
from services.tokenizer.manager import ReqOutput
from services.tokenizer.protocol import (
    FUNCTION_NAME,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ToolCallDelta,
)
from services.tokenizer.serving_base import ChoiceAccumulator
from services.tokenizer.serving_chat import ChatEndpoint
from services.tokenizer.sse import Chunk, NamedEvent, TextDelta

# ----------------------------------------------------------------------------- request


class _Request(BaseModel):
    """Fields typed strictly, unknown ones ignored. Input items are often copied from an
    earlier response's `output`: the fields that only describe that response (`id`,
    `status`, `annotations`) are among those ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Request):
    type: Literal["input_text", "output_text"]
    text: str


def _parts(content: object) -> object:
    """A string is one text part, so that content is always a list of parts."""
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    if not isinstance(content, list):
        raise ValueError("must be a string or a list of text parts")
    return content


TextParts = Annotated[list[TextPart], BeforeValidator(_parts)]


def _joined(parts: list[TextPart]) -> str:
    """Parts joined with newlines, as chat joins its text parts."""
    return "\n".join(part.text for part in parts)


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: TextParts

    @property
    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(_Request):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Request):
    """The client's result of an earlier call."""

    type: Literal["function_call_output"]
    call_id: str
    output: TextParts

    @property
    def text(self) -> str:
        return _joined(self.output)


class ReasoningItem(_Request):
    """An earlier turn's reasoning, sent back as `to_response` gave it. Chat messages
    carry no reasoning (chat templates drop earlier turns' reasoning), so it is dropped."""

    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(_Request):
    """A Responses function tool: flat, where chat nests the function under `function`."""

    type: Literal["function"]
    name: str = Field(json_schema_extra={"pattern": FUNCTION_NAME})
    """Checked as chat checks it, once translated (`to_chat_request`)."""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # Refused unless absent or a default (`_TOOL_DEFAULTS`).
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    output_schema: dict[str, Any] | None = None


_TOOL_DEFAULTS: dict[str, tuple[object, ...]] = {
    "defer_loading": (None, False),
    "allowed_callers": (None, ["direct"]),
    "output_schema": (None,),
}
"""A tool is always in the prompt and called by the model itself; an output schema would
need a place in the chat template, which has none."""


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


ToolChoiceMode = Literal["auto", "none", "required"]
ToolChoice = ToolChoiceMode | FunctionChoice


class TextFormat(_Request):
    """`text.format`: the fields of `json_schema` are flat here, nested in chat."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_when_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError('type "json_schema" needs a name and a schema')
        return self


class TextConfig(_Request):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _default_verbosity(self) -> TextConfig:
        if self.verbosity not in (None, "medium"):
            raise _unsupported("text.verbosity", self.verbosity)
        return self


ModelT = TypeVar("ModelT", bound=BaseModel)


def _parse(model: type[ModelT], value: object, param: str) -> ModelT:
    """`value` as `model`, its first error named by its place in the request."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        kind = error["type"]
        cause = (error.get("ctx") or {}).get("error")
        reason = str(cause) if kind == "value_error" and cause is not None else error["msg"]
        code = (
            "missing_required_parameter"
            if kind == "missing"
            else "invalid_type"
            if kind.endswith("_type")
            else "invalid_value"
        )
        raise RequestError(f"{where}: {reason}", param=where, code=code) from None


def _unsupported(param: str, value: object) -> RequestError:
    return RequestError(
        f"{param} {json.dumps(value)} is not supported by this server; omit it",
        param=param,
        code="unsupported_parameter",
    )


def _check_defaults(obj: BaseModel, defaults: dict[str, tuple[object, ...]], prefix: str) -> None:
    """Refuse a field of `defaults` sent with a value not among its defaults; an object's
    null members are dropped before comparing."""
    for name, accepted in defaults.items():
        value = getattr(obj, name)
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if v is not None}
        if value not in accepted:
            raise _unsupported(prefix + name, getattr(obj, name))


_STATEFUL = ("previous_response_id", "conversation")
_DEFAULTS: dict[str, tuple[object, ...]] = {
    "background": (None, False),
    "context_management": (None, []),
    "include": (None, []),
    "moderation": (None,),
    "prompt": (None,),
    "prompt_cache_options": (None,),
    "prompt_cache_retention": (None, "in_memory"),
    "reasoning": (None, {}),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
}
"""Fields not served, and the values that ask for nothing beyond what the server does: the
radix cache is in memory, reasoning (with a reasoning parser) cannot be configured, a
prompt is never truncated."""


class ResponsesRequest(_Request):
    """A `POST /v1/responses` body: every field of OpenAI's, each served, ignored on
    purpose or refused; `RequestError` for what is refused beyond a type error."""

    model: str | None = None
    """Omitted: the served model."""
    input: list[InputItem]
    """A string is one user message."""
    instructions: str | None = None
    """A system message before the input."""
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    """Echoed in the response."""
    # Ignored on purpose: nothing is stored, no built-in tool is called, there is one
    # service tier, nothing pads a stream, and the identifiers only serve OpenAI's own
    # routing and abuse detection. All but `stream_options` are echoed.
    store: bool | None = None
    max_tool_calls: int | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Refused unless absent or a default (`_STATEFUL`, `_DEFAULTS`).
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    context_management: list[dict[str, Any]] | None = None
    include: list[str] | None = None
    moderation: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None

    @field_validator(
        "input",
        mode="plain",
        json_schema_input_type=str | Annotated[list[InputItem], Field(min_length=1)],
    )
    @classmethod
    def _input_items(cls, value: object) -> list[InputItem]:
        if isinstance(value, str):
            return [MessageItem(role="user", content=[TextPart(type="input_text", text=value)])]
        if not isinstance(value, list) or not value:
            raise RequestError(
                "input must be a string or a non-empty list of input items", param="input"
            )
        items = []
        for i, raw in enumerate(value):
            if not isinstance(raw, dict):
                raise RequestError(f"input[{i}] must be an input item object", param=f"input[{i}]")
            kind = raw.get("type", "message")
            model = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
            if model is None:
                raise RequestError(
                    f"input[{i}].type {json.dumps(kind)} is not supported by this server; it "
                    "takes message, function_call, function_call_output and reasoning items",
                    param=f"input[{i}].type",
                )
            items.append(_parse(model, raw, f"input[{i}]"))
        return items

    @field_validator("tools", mode="plain", json_schema_input_type=list[FunctionTool] | None)
    @classmethod
    def _function_tools(cls, value: object) -> list[FunctionTool]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise RequestError("tools must be a list of function tools", param="tools")
        for i, raw in enumerate(value):
            if isinstance(raw, dict) and raw.get("type") != "function":
                raise RequestError(
                    f"tools[{i}].type {json.dumps(raw.get('type'))} is not supported: this "
                    'server runs no built-in tools, only {"type": "function"} ones',
                    param=f"tools[{i}].type",
                    code="unsupported_parameter",
                )
        tools = [_parse(FunctionTool, raw, f"tools[{i}]") for i, raw in enumerate(value)]
        for i, tool in enumerate(tools):
            _check_defaults(tool, _TOOL_DEFAULTS, f"tools[{i}].")
        return tools

    @field_validator("tool_choice", mode="plain", json_schema_input_type=ToolChoice | None)
    @classmethod
    def _tool_choice(cls, value: object) -> ToolChoice | None:
        if value is None:
            return None
        if isinstance(value, str) and value in get_args(ToolChoiceMode):
            return cast(ToolChoiceMode, value)
        if isinstance(value, dict) and value.get("type") not in (None, "function"):
            raise RequestError(
                f"tool_choice.type {json.dumps(value.get('type'))} is not supported by this server",
                param="tool_choice.type",
                code="unsupported_parameter",
            )
        if not isinstance(value, dict):
            raise RequestError(
                'tool_choice must be "auto", "none", "required" or '
                '{"type": "function", "name": ...}',
                param="tool_choice",
            )
        return _parse(FunctionChoice, value, "tool_choice")

    @field_validator("text", mode="plain", json_schema_input_type=TextConfig | None)
    @classmethod
    def _text_config(cls, value: object) -> TextConfig | None:
        return None if value is None else _parse(TextConfig, value, "text")

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        for name in _STATEFUL:
            if getattr(self, name) is not None:
                raise RequestError(
                    f"this server is stateless: it stores no responses, so {name} cannot be "
                    "used; send the whole conversation in input",
                    param=name,
                    code="unsupported_parameter",
                )
        _check_defaults(self, _DEFAULTS, "")
        self._check_references()
        return self

    def _check_references(self) -> None:
        """What the chat template could not render: a result of a call never made, a
        forced tool that does not exist."""
        calls: set[str] = set()
        for i, item in enumerate(self.input):
            if isinstance(item, FunctionCallItem):
                calls.add(item.call_id)
            elif isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
                raise RequestError(
                    f"input[{i}].call_id {item.call_id!r} is the output of no call: no "
                    "function_call item before it has that call_id",
                    param=f"input[{i}].call_id",
                )
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice) and choice.name not in {t.name for t in self.tools}:
            raise RequestError(
                f"tool_choice.name {choice.name!r} is not a function in tools",
                param="tool_choice.name",
            )


# ------------------------------------------------------------------------ to chat and back


def to_chat_request(req: ResponsesRequest) -> dict[str, Any]:
    """The chat-completions body that asks for the same answer, in OpenAI's chat shapes.
    A stream asks for the usage chunk, which `ResponsesStream.finish` reports."""
    body: dict[str, Any] = {"messages": _chat_messages(req)}
    if req.tools:
        body["tools"] = [_chat_tool(tool) for tool in req.tools]
    choice = req.tool_choice
    optional = {
        "model": req.model,
        "tool_choice": (
            {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, FunctionChoice)
            else choice
        ),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "response_format": None if req.text is None else _response_format(req.text.format),
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if req.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def _chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """Consecutive function calls are one assistant message with `tool_calls`, joined to
    the assistant's text before them: the inverse of `to_response`, which splits one chat
    answer into a message item and call items. Reasoning items are dropped."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    for item in req.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function = {
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _response_format(fmt: TextFormat) -> dict[str, Any] | None:
    """Plain text needs no chat `response_format`."""
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {
        "name": fmt.name,
        "description": fmt.description,
        "schema": fmt.schema_,
        "strict": fmt.strict,
    }
    return {
        "type": "json_schema",
        "json_schema": {k: v for k, v in schema.items() if v is not None},
    }


_CHAT_PARAMS = (
    (re.compile(r"\bmessages(\[\d+\])?(\.[\w.]+)?"), "input"),
    (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\btools(\[\d+\])\.function\b"), r"tools\1"),
    (re.compile(r"\btool_choice\.function\b"), "tool_choice"),
)
"""Chat's names for what the Responses request calls otherwise. A message index names no
input item (instructions and joined calls shift them), so it names `input` as a whole."""


def responses_error(err: RequestError) -> RequestError:
    """An error of the chat flow (`max_tokens` too large) in the Responses request's own
    names (`max_output_tokens`), so the client is told about a field it sent."""
    message, param = err.message, err.param
    for pattern, name in _CHAT_PARAMS:
        message = pattern.sub(name, message)
        param = None if param is None else pattern.sub(name, param)
    return RequestError(message, param=param, code=err.code, status=err.status)


def to_response(
    req: ResponsesRequest, chat_response: dict[str, Any], response_id: str, created_at: int
) -> dict[str, Any]:
    """The Response for a chat.completion answer of `to_chat_request(req)`, its items in
    OpenAI's order: the reasoning, the message, one function_call per tool call."""
    choice = chat_response["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    for kind in (REASONING, MESSAGE):
        if message.get(kind.chat_field):
            item = kind.item(_item_id(response_id, kind.prefix, len(output)), "completed")
            item["content"].append(kind.part(message[kind.chat_field]))
            output.append(item)
    for call in message.get("tool_calls") or []:
        function = call["function"]
        item_id = _item_id(response_id, "fc", len(output))
        output.append(
            _function_call_item(item_id, call["id"], function["name"], function["arguments"])
        )
    status = _status(choice["finish_reason"])
    if output:
        output[-1]["status"] = status  # the item being generated when it stopped
    return _response(
        req,
        response_id,
        created_at,
        chat_response["model"],
        status=status,
        output=output,
        usage=_usage(chat_response["usage"]),
    )


Status = Literal["in_progress", "completed", "incomplete"]


def _status(finish_reason: str | None) -> Status:
    return "incomplete" if finish_reason == "length" else "completed"


def _item_id(response_id: str, prefix: str, output_index: int) -> str:
    """Item ids follow from the response's and the item's place in the output, so the
    streamed answer and the whole one name their items alike."""
    return f"{prefix}_{response_id.removeprefix('resp_')}_{output_index}"


@dataclass(frozen=True)
class TextKind:
    """An output item of one text part: the message, or the reasoning (chat's
    `reasoning_content`), which OpenAI returns as raw `reasoning_text` content."""

    item_type: Literal["message", "reasoning"]
    chat_field: str
    prefix: str
    part_type: str
    """Also the stem of its stream events: `response.<part_type>.delta`."""

    def item(self, item_id: str, status: Status) -> dict[str, Any]:
        fields: dict[str, Any] = (
            {"role": "assistant"} if self.item_type == "message" else {"summary": []}
        )
        return {"id": item_id, "type": self.item_type, **fields, "status": status, "content": []}

    def part(self, text: str) -> dict[str, Any]:
        extra: dict[str, Any] = {"annotations": []} if self.item_type == "message" else {}
        return {"type": self.part_type, "text": text, **extra}

    @property
    def event_extra(self) -> dict[str, Any]:
        """Output text events carry logprobs, never asked for here."""
        return {"logprobs": []} if self.item_type == "message" else {}


MESSAGE = TextKind("message", "content", "msg", "output_text")
REASONING = TextKind("reasoning", "reasoning_content", "rs", "reasoning_text")
_TEXT_KINDS = {kind.item_type: kind for kind in (MESSAGE, REASONING)}


def _function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: Status = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage in Responses' names. No cache writes: the radix cache is implicit, and
    chat's usage reports none."""
    details = usage.get("prompt_tokens_details") or {}
    output_details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": details.get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": output_details.get("reasoning_tokens", 0)},
        "total_tokens": usage["total_tokens"],
    }


def _response(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    *,
    status: Status,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The Response object: the request's parameters as they were applied (omitted
    sampling parameters are the engine's defaults, which are OpenAI's)."""
    choice = req.tool_choice
    text = TextConfig() if req.text is None else req.text
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        "usage": usage,
        "instructions": req.instructions,
        "tools": [tool.model_dump() for tool in req.tools],
        "tool_choice": choice.model_dump()
        if isinstance(choice, FunctionChoice)
        else choice or "auto",
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_logprobs": 0,
        "text": text.model_dump(by_alias=True, exclude_none=True),
        "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "background": False,
        "store": False,
        "previous_response_id": None,
        "metadata": req.metadata or {},
        "user": req.user,
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
    }


# ---------------------------------------------------------------------------- streaming


class ResponsesStream:
    """The Responses events of one streamed request, from the typed chunks of
    `to_chat_request(req)`'s chat stream, as OpenAI orders them: the response created and in
    progress; each output item added, its deltas and done before the next is added; then
    the response completed (or incomplete) with the usage of the final chunk.

    Chat streams its reasoning, then its text, then each tool call whole before the next;
    text after a call is a new item.
    """

    def __init__(self, req: ResponsesRequest, response_id: str, created_at: int, model: str):
        """`model` is the served model: the request may omit it, and the events before the
        first chunk name it."""
        self.req = req
        self.response_id = response_id
        self.created_at = created_at
        self.model = model
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        """The items so far, as they stand; the last is open while "in_progress"."""
        self.open_call: int | None = None
        """The chat tool call index of the last function_call item."""
        self.calls_seen: set[int] = set()
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def start(self) -> list[NamedEvent]:
        response = self._response("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def feed(self, chunk: ChatCompletionChunk | TextDelta) -> list[NamedEvent]:
        """Events for one chat chunk (none for the role-only first one and the usage one);
        a `TextDelta` is plain content."""
        if isinstance(chunk, TextDelta):
            return self._text(MESSAGE, chunk.text)
        if chunk.usage is not None:
            self.usage = _usage(chunk.usage.model_dump())
        events: list[NamedEvent] = []
        for choice in chunk.choices:
            for kind in (REASONING, MESSAGE):
                if text := getattr(choice.delta, kind.chat_field):
                    events += self._text(kind, text)
            for call in choice.delta.tool_calls or ():
                events += self._call(call)
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        return events

    def finish(self) -> list[NamedEvent]:
        """The closing events, once the chat stream has ended (its usage chunk fed)."""
        status = _status(self.finish_reason)
        events = self._close(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self._response(status))]

    def error(self, err: RequestError) -> list[NamedEvent]:
        """A stream cannot change its HTTP status once started: the error is an event."""
        return [self._event("error", code=err.code, message=err.message, param=err.param)]

    def _open_item(self) -> dict[str, Any] | None:
        item = self.output[-1] if self.output else None
        return item if item is not None and item["status"] == "in_progress" else None

    def _text(self, kind: TextKind, text: str) -> list[NamedEvent]:
        events: list[NamedEvent] = []
        item = self._open_item()
        if item is None or item["type"] != kind.item_type:
            events += self._close("completed")
            item = kind.item(self._next_id(kind.prefix), "in_progress")
            events.append(self._add(item))
            part = kind.part("")
            item["content"].append(part)
            events.append(self._event("response.content_part.added", **self._at(), part=dict(part)))
        item["content"][0]["text"] += text
        events.append(
            self._event(
                f"response.{kind.part_type}.delta", **self._at(), delta=text, **kind.event_extra
            )
        )
        return events

    def _call(self, call: ToolCallDelta) -> list[NamedEvent]:
        index, function = call.index, call.function
        events: list[NamedEvent] = []
        item = self._open_item()
        if item is None or item["type"] != "function_call" or self.open_call != index:
            if index in self.calls_seen:
                raise ValueError(f"the chat stream went back to tool call {index}")
            if call.id is None or function.name is None:
                raise ValueError(f"the chat stream's tool call {index} opens with no id or name")
            events += self._close("completed")
            item_id = self._next_id("fc")
            item = _function_call_item(item_id, call.id, function.name, "", "in_progress")
            events.append(self._add(item))
            self.open_call = index
            self.calls_seen.add(index)
        if function.arguments:
            item["arguments"] += function.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    **self._at(content=False),
                    delta=function.arguments,
                )
            )
        return events

    def _add(self, item: dict[str, Any]) -> NamedEvent:
        """The event shows `item` as it is now: the stream goes on filling it."""
        self.output.append(item)
        return self._event(
            "response.output_item.added",
            output_index=len(self.output) - 1,
            item=copy.deepcopy(item),
        )

    def _close(self, status: Status) -> list[NamedEvent]:
        """The done events of the open item, if any, which ends with `status`."""
        item = self._open_item()
        if item is None:
            return []
        item["status"] = status
        if item["type"] == "function_call":
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    **self._at(content=False),
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        else:
            kind, part = _TEXT_KINDS[item["type"]], item["content"][0]
            events = [
                self._event(
                    f"response.{kind.part_type}.done",
                    **self._at(),
                    text=part["text"],
                    **kind.event_extra,
                ),
                self._event("response.content_part.done", **self._at(), part=part),
            ]
        events.append(
            self._event("response.output_item.done", output_index=len(self.output) - 1, item=item)
        )
        return events

    def _next_id(self, prefix: str) -> str:
        return _item_id(self.response_id, prefix, len(self.output))

    def _at(self, content: bool = True) -> dict[str, Any]:
        """Where an event of the last item points: its id, its place, its one part."""
        at: dict[str, Any] = {
            "item_id": self.output[-1]["id"],
            "output_index": len(self.output) - 1,
        }
        if content:
            at["content_index"] = 0
        return at

    def _response(self, status: Status) -> dict[str, Any]:
        output = [] if status == "in_progress" else self.output
        usage = None if status == "in_progress" else self.usage
        return _response(
            self.req,
            self.response_id,
            self.created_at,
            self.model,
            status=status,
            output=output,
            usage=usage,
        )

    def _event(self, kind: str, **fields: Any) -> NamedEvent:
        """One event, named as OpenAI names it; nothing it holds changes afterwards (an
        item or part still being filled is given as a copy)."""
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return NamedEvent(kind, payload)


# ---------------------------------------------------------------------------- the endpoint


class ResponsesEndpoint(ChatEndpoint):
    """The request translated into a chat completion (`to_chat_request`), served as one,
    and its answer or chunks translated back into a Response and its events. Stateless:
    nothing is stored. Its stream ends with its last event, not `[DONE]`."""

    id_prefix = "resp"
    prompt_param = "input"
    ends_with_done = False

    def __init__(self, request: ResponsesRequest, model: str, parsers: ChatParsers):
        body = ChatCompletionRequest.model_validate(to_chat_request(request))
        super().__init__(body, model, parsers)
        self.request = request
        self.responses = ResponsesStream(request, self.id, self.header.created, model)
        self.started = False

    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[Chunk]:
        opening = [] if self.started else self.responses.start()
        self.started = True
        return [*opening, *self._translated(super().events(out, choice, acc))]

    def end(self) -> list[Chunk]:
        return [*self._translated(super().end()), *self.responses.finish()]

    def error(self, err: RequestError) -> list[Chunk]:
        return [*self.responses.error(responses_error(err))]

    def answer(self, choices: list[ChoiceOutput]) -> Any:
        chat = super().answer(choices)
        return to_response(self.request, chat, self.id, self.header.created)

    def _translated(self, chunks: list[Chunk]) -> list[NamedEvent]:
        events: list[NamedEvent] = []
        for chunk in chunks:
            assert isinstance(chunk, ChatCompletionChunk | TextDelta), "a chat stream's chunk"
            events += self.responses.feed(chunk)
        return events
