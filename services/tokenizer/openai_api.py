"""Wire models of the OpenAI-compatible API and SGLang's native `/generate`.

Requests validate the types of the fields they know (strictly: `"n": "2"` is an error, not
a 2) and ignore the fields they don't, because OpenAI clients send some we do not
implement (`user`, `service_tier`, ...). Value ranges are checked once, by
`SamplingParams.verify`, through `adapters.to_sampling_params`.

The union-typed inputs (message content, `stop`, `prompt`) are normalised by a
before-validator that also checks their shape, so a client sees one clear message naming
the field instead of one error per union member.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    model_serializer,
    model_validator,
)

# ---------------------------------------------------------------------------- requests


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


def _stop_list(stop: object) -> object:
    if isinstance(stop, str):
        return [stop]
    if stop is None or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return stop
    raise ValueError("must be a string or a list of strings")


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompt_batch(prompt: object) -> object:
    """Any of the four prompt forms becomes a batch: a list of texts or a list of token-id lists."""
    if isinstance(prompt, str) or (_is_token_ids(prompt) and prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            "must be a non-empty string, list of strings, list of token ids "
            "or list of token-id lists"
        )
    if all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt):
        if any(len(p) == 0 for p in prompt):
            raise ValueError("an empty prompt has nothing to continue from")
        return prompt
    raise ValueError(
        "must be a string, a list of strings, a list of token ids or a list of token-id lists, "
        "not a mix"
    )


TextContent = Annotated[str | None, BeforeValidator(_join_text_parts)]
StopList = Annotated[list[str] | None, BeforeValidator(_stop_list)]
PromptBatch = Annotated[list[str] | list[list[int]], BeforeValidator(_prompt_batch)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ChatCompletionMessageParam(_Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: TextContent = None
    """A string, or a list of text parts joined into one string."""


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`: the schema under `schema`, with a name."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """`text` (no constraint), `json_object` (any JSON object) or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError(
                'type "json_schema" needs a json_schema object: {"name": ..., "schema": {...}}'
            )
        return self

    def grammar_schema(self) -> dict[str, Any] | None:
        """The JSON schema this format constrains output to, None for plain text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema" and self.json_schema is not None:
            return self.json_schema.schema_
        return None


class SamplingRequest(_Request):
    """The fields chat and completions share. `None` means the engine's default
    (`SamplingParams`), which follows OpenAI's (temperature 1.0, top_p 1.0)."""

    model: str | None = None
    """Omitted: the served model."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: StopList = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # Extras beyond OpenAI, with vLLM's and SGLang's names.
    regex: str | None = None
    """Constrain the output to this regular expression (xgrammar's syntax)."""
    ebnf: str | None = None
    """Constrain the output to this EBNF grammar (xgrammar's GBNF dialect, `root` first)."""
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    cache_salt: str | None = None
    """Radix-cache namespace: requests with different salts share no KV."""
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    """Any 64-bit integer (the wire carries no more)."""

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatCompletionMessageParam] = Field(min_length=1)
    max_completion_tokens: int | None = None
    """OpenAI's newer name for `max_tokens`; wins when both are sent."""
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(SamplingRequest):
    prompt: PromptBatch
    """A text, a list of texts, a list of token ids or a list of token-id lists; always
    held as a batch (a list of texts or a list of token-id lists)."""
    logprobs: int | None = None
    """How many top alternatives to return per token; 0 returns the sampled token's only."""


class GenerateRequest(_Request):
    """SGLang's native `/generate`: `sampling_params` uses the engine's own names."""

    text: Annotated[list[str], BeforeValidator(_prompt_batch)] | None = None
    """One text or a batch; held as a batch."""
    input_ids: Annotated[list[list[int]], BeforeValidator(_prompt_batch)] | None = None
    """One token-id list or a batch; held as a batch."""
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    _is_batch: bool = PrivateAttr(default=False)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_batch(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> GenerateRequest:
        """SGLang answers a batch with a list and a single prompt with one object, so the
        form sent must outlive the normalisation to a batch."""
        request = handler(data)
        if isinstance(data, dict):
            text, input_ids = data.get("text"), data.get("input_ids")
            request._is_batch = isinstance(text, list) or (
                isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
            )
        return request

    @model_validator(mode="after")
    def _one_prompt_form(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self

    @property
    def is_batch(self) -> bool:
        return self._is_batch

    @property
    def prompt_field(self) -> Literal["text", "input_ids"]:
        return "text" if self.text is not None else "input_ids"

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        return getattr(self, self.prompt_field)


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens served from the radix cache (not recomputed)."""


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[ChatCompletionTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


FinishReasonName = Literal["stop", "length"]


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

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


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None = None


ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class ChoicesEnvelope(BaseModel, Generic[ChoiceT]):
    """What OpenAI puts around the choices of a response and of a stream chunk, in its
    field order; a subclass fixes `object`. A chunk's `usage` is null but in the last
    chunk of a stream with `include_usage`."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChoiceT]
    usage: UsageInfo | None = None


class ChatCompletionResponse(ChoicesEnvelope[ChatCompletionResponseChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: UsageInfo


class ChatCompletionChunk(ChoicesEnvelope[ChatCompletionResponseStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionResponse(ChoicesEnvelope[CompletionResponseChoice]):
    object: Literal["text_completion"] = "text_completion"
    usage: UsageInfo


class CompletionChunk(ChoicesEnvelope[CompletionResponseChoice]):
    object: Literal["text_completion"] = "text_completion"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "radixserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, which its clients parse into typed exceptions."""

    error: ErrorInfo
