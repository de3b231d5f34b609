"""`/v1/chat/completions`' wire models: the conversation, tools and tool choice in; the
message, its logprobs and its stream deltas out (shared fields: `protocol.common`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_serializer,
    model_validator,
)

from services.tokenizer.protocol.common import (
    ChoicesEnvelope,
    FinishReasonName,
    IgnoredText,
    Logprob,
    Refused,
    SamplingRequest,
    StrictModel,
    UsageInfo,
    refused_unless,
)


def _join_text_parts(content: object) -> object:
    """A list of text parts becomes one string: the server is text-only and chat templates
    expect strings. Parts are joined with newlines, as vLLM does."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            raise ValueError(
                'content parts must be {"type": "text", "text": <string>}; '
                "this server accepts text only"
            )
        texts.append(part["text"])
    return "\n".join(texts)


_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
TextContent = Annotated[
    str | None,
    BeforeValidator(_join_text_parts),
    WithJsonSchema(
        {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]}
    ),
]


class FunctionCall(StrictModel):
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


class ToolCallParam(StrictModel):
    """An assistant message's earlier tool call, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


_NO_CALLS = {"tool_calls": {"type": "null"}}
_ROLE_FIELDS: dict[str, Any] = {
    "anyOf": [
        {"properties": {"role": {"enum": ["system", "developer", "user"]}, **_NO_CALLS}},
        {"properties": {"role": {"const": "assistant"}}},
        {
            "properties": {
                "role": {"const": "tool"},
                "tool_call_id": {"type": "string"},
                **_NO_CALLS,
            },
            "required": ["tool_call_id"],
        },
    ]
}
"""`_tool_fields_on_their_roles` in the JSON schema: what each role may carry."""


class ChatCompletionMessageParam(StrictModel):
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_ROLE_FIELDS)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: TextContent = None
    """A string, or a list of text parts joined into one string."""
    name: IgnoredText = None
    tool_calls: list[ToolCallParam] | None = None
    """Only on an assistant message: the calls it made."""
    tool_call_id: str | None = None
    """Only on a tool message: the call whose result it carries."""

    @model_validator(mode="after")
    def _tool_fields_on_their_roles(self) -> ChatCompletionMessageParam:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self


FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
"""What a function's name may be (OpenAI's rule)."""


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; omitted: any object."""
    strict: bool | None = None
    """Arguments always follow the schema when the call is forced (tool_choice required or
    named); under "auto" the parser returns what the model wrote."""


class ChatCompletionToolParam(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


_TOOL_CHOICES = ("none", "auto", "required")


def _tool_choice(value: object) -> object:
    """One of the three words or a named function, with one message for a wrong one."""
    if isinstance(value, str) and value not in _TOOL_CHOICES:
        raise ValueError(
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )
    if isinstance(value, dict):
        return NamedToolChoice.model_validate(value)
    return value


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice, BeforeValidator(_tool_choice)
]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatCompletionMessageParam] = Field(min_length=1)
    max_completion_tokens: int | None = None
    """OpenAI's newer name for `max_tokens`; wins when both are sent."""
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: ToolChoice | None = None
    """Omitted: "auto" with tools, "none" without."""
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables of the chat template, e.g. `{"enable_thinking": false}`."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Continue the last (assistant) message instead of opening a new turn."""
    metadata: dict[str, str] | None = None
    """Ignored on purpose, as `store`: nothing is stored."""
    store: bool | None = None
    service_tier: IgnoredText = None
    prompt_cache_key: IgnoredText = None
    safety_identifier: IgnoredText = None
    audio: Refused = None
    modalities: Annotated[object, refused_unless(None, ["text"])] = None
    prediction: Refused = None
    web_search_options: Refused = None
    functions: Annotated[object, refused_unless(None, hint="; send tools")] = None
    function_call: Annotated[object, refused_unless(None, hint="; send tool_choice")] = None
    reasoning_effort: Refused = None
    verbosity: Refused = None
    echo: Annotated[object, refused_unless(None, False)] = None
    documents: Refused = None
    chat_template: Refused = None
    mm_processor_kwargs: Refused = None
    prompt_logprobs: Refused = None

    @property
    def effective_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class TopLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[ChatCompletionTokenLogprob] | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str
    """Compact JSON text of the arguments object."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    """The reasoning section (`--reasoning-parser`); absent without one."""
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_extras(self, handler: Any) -> dict[str, Any]:
        """`content` is always present (null with tool calls only), the extras only when set."""
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None or k == "content"}


class ToolCallDeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    """One streamed piece of a tool call: the first carries `id`, `type` and the name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction

    @model_serializer(mode="wrap")
    def _only_set(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: Any) -> dict[str, Any]:
        """A delta carries only what changed: `{"role": ...}` first, then `{"content": ...}`,
        and `{}` in the chunk that ends a choice, as OpenAI streams it."""
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionResponse(ChoicesEnvelope[ChatCompletionResponseChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: UsageInfo


class ChatCompletionChunk(ChoicesEnvelope[ChatCompletionResponseStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
