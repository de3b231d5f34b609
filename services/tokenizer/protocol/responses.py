"""`/v1/responses`' request: its input items, function tools, tool choice and text format,
each refusal a `RequestError` naming the field (`tools[1].type`); the server is stateless,
so `previous_response_id` and `conversation` are refused (`serving_responses`)."""

from __future__ import annotations

import json
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

from services.tokenizer.errors import RequestError
from services.tokenizer.protocol.chat import FUNCTION_NAME


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
