"""What the OpenAI-compatible requests and responses share: the strict base model, the
refusal of fields known and not served, the sampling fields of chat and completions, usage,
the envelope around choices, model cards, rendered requests and the error body.

Requests validate the types of the fields they know (strictly: `"n": "2"` is an error, not
a 2). Fields nobody implements here fall in three kinds (docs/api.md lists them): fields
ignored on purpose (`user`, `metadata`, ...) are accepted, fields we know and do not
serve are a 400 naming them unless sent at their default (SDKs send many at their
defaults), and fields we have never heard of are ignored, as OpenAI's own server does.
Value ranges are checked once, by `SamplingParams.verify`, and sizes against the
server's limits, through `request_mapper.to_sampling_params`.

The union-typed inputs (message content, `stop`, `prompt`) are normalised by a
before-validator that also checks their shape, so a client sees one clear message naming
the field instead of one error per union member.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializeAsAny,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import GetJsonSchemaHandler, JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError


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


def prompt_batch(prompt: object) -> object:
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


TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
TEXT_SCHEMA = {"type": "string", "minLength": 1}


StopList = Annotated[
    list[str] | None,
    BeforeValidator(_stop_list),
    WithJsonSchema(
        {"anyOf": [TEXT_SCHEMA, {"type": "array", "items": TEXT_SCHEMA}, {"type": "null"}]}
    ),
]
PromptBatch = Annotated[
    list[str] | list[list[int]],
    BeforeValidator(prompt_batch),
    WithJsonSchema(
        {
            "anyOf": [
                TEXT_SCHEMA,
                {"type": "array", "items": TEXT_SCHEMA, "minItems": 1},
                TOKEN_IDS_SCHEMA,
                {"type": "array", "items": TOKEN_IDS_SCHEMA, "minItems": 1},
            ]
        }
    ),
]
"""The four prompt forms as the JSON schema shows them; held as a batch."""


def _same(value: object, default: object) -> bool:
    """Equal and of the same kind: `false` is not `0`, but `1` is `1.0`."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default


@dataclass(frozen=True, slots=True)
class _Refusal(AfterValidator):
    """`refused_unless`' check, documented as what it accepts: one of `defaults`."""

    defaults: tuple[object, ...] = ()

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {"enum": list(self.defaults), "description": "Not supported by this server."}


def refused_unless(*defaults: object, hint: str = "") -> AfterValidator:
    """A field we know and do not serve: accepted only at one of `defaults`, the values
    that ask for nothing (clients send many fields at their defaults)."""

    def check(value: object) -> object:
        if not any(_same(value, d) for d in defaults):
            shown = " or ".join(json.dumps(d) for d in defaults)
            raise PydanticCustomError(
                "unsupported",
                "{message}",
                {"message": f"not supported by this server; send {shown} or leave it out{hint}"},
            )
        return value

    return _Refusal(check, defaults)


Refused = Annotated[object, refused_unless(None)]
"""A field we do not serve, accepted only as null."""
IgnoredText = Annotated[str | None, Field(json_schema_extra={"ignored": True})]
"""A field accepted and ignored on purpose (docs/api.md lists them)."""
_GUIDED = refused_unless(None, hint="; vLLM's structured_outputs replaces the guided_* fields")


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None
    """Ignored on purpose: nothing here pads the stream."""


class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`: the schema under `schema`, with a name."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
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


def _given(name: str) -> dict[str, Any]:
    """Holds when `name` is set to something `_one_constraint` counts (not empty, not false)."""
    return {"required": [name], "properties": {name: {"not": {"enum": [None, False, "", [], {}]}}}}


_ONE_CONSTRAINT: dict[str, Any] = {
    "oneOf": [_given(k) for k in ("json", "regex", "choice", "grammar", "json_object")]
}
"""`_one_constraint` in the JSON schema."""


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs`: one constraint, mapped onto the same grammars as
    `response_format`, `regex` and `ebnf`."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Refused = None
    whitespace_pattern: Refused = None
    disable_any_whitespace: bool | None = None
    """Ignored on purpose: JSON is always generated without free whitespace."""

    model_config = ConfigDict(
        strict=True,
        extra="ignore",
        populate_by_name=True,
        json_schema_extra=_ONE_CONSTRAINT,
    )

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [
            k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(self, k)
        ]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and json_object")
        return self

    def as_grammar(self) -> tuple[str, str | dict[str, Any]]:
        """(kind, source) in `SamplingParams`' grammar kinds; a `choice` is an EBNF of its
        literal alternatives."""
        if self.json_ is not None:
            return "json_schema", self.json_
        if self.json_object:
            return "json_schema", {"type": "object"}
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "ebnf", "root ::= " + " | ".join(json.dumps(c) for c in self.choice)
        assert self.grammar is not None, "_one_constraint leaves one"
        return "ebnf", self.grammar


class SamplingRequest(StrictModel):
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
    user: IgnoredText = None
    # Extras beyond OpenAI, with vLLM's and SGLang's names.
    regex: str | None = None
    """Constrain the output to this regular expression (xgrammar's syntax)."""
    ebnf: str | None = None
    """Constrain the output to this EBNF grammar (xgrammar's GBNF dialect, `root` first)."""
    structured_outputs: StructuredOutputs | None = None
    json_schema_best_effort: bool = False
    """Serve a JSON schema (`response_format`, a forced tool, `structured_outputs`) even where
    it uses keywords the grammar does not enforce, which are then ignored; without it such a
    schema is a 400 naming the keyword."""
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
    # Known and not served: a 400 unless sent at the value that asks for nothing.
    best_of: Annotated[object, refused_unless(None, 1)] = None
    use_beam_search: Annotated[object, refused_unless(None, False)] = None
    length_penalty: Annotated[object, refused_unless(None, 1.0)] = None
    include_stop_str_in_output: Annotated[object, refused_unless(None, False)] = None
    spaces_between_special_tokens: Annotated[object, refused_unless(None, True)] = None
    truncate_prompt_tokens: Refused = None
    allowed_token_ids: Refused = None
    bad_words: Refused = None
    return_tokens_as_token_ids: Annotated[object, refused_unless(None, False)] = None
    guided_json: Annotated[object, _GUIDED] = None
    guided_regex: Annotated[object, _GUIDED] = None
    guided_choice: Annotated[object, _GUIDED] = None
    guided_grammar: Annotated[object, _GUIDED] = None
    lora_path: Refused = None
    return_hidden_states: Annotated[object, refused_unless(None, False)] = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens served from the radix cache (not recomputed)."""


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


Logprob = Annotated[float, Field(allow_inf_nan=False)]
"""A logprob as a response carries it: refused at construction unless finite, so that a
NaN or -inf that escaped `choice_output.LOGPROB_FLOOR` fails loudly instead of going out as
pydantic's `null`."""


FinishReasonName = Literal["stop", "length", "tool_calls", "abort"]


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "radixserve"
    max_model_len: int | None = None


class LoRAModelCard(ModelCard):
    """A LoRA adapter, served under its name: `parent` is the base model's id (vLLM's shape)."""

    parent: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SerializeAsAny[ModelCard]]


class RenderedSamplingParams(BaseModel):
    """vLLM's `SamplingParams` as its render endpoints answer them, for the fields this
    server has: the request's values with the server's defaults and limits applied."""

    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    temperature: float
    top_p: float
    top_k: int
    """-1: no top-k (vLLM reads 0 and -1 alike)."""
    min_p: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    max_tokens: int
    """The room the request is given: its own, clamped to `--max-tokens-cap`, or by
    default what the context leaves after the prompt."""
    min_tokens: int
    logprobs: int | None
    """Alternatives per output token; None: no logprobs."""
    prompt_logprobs: int | None
    """Alternatives per prompt token; None: no prompt logprobs."""
    skip_special_tokens: bool
    structured_outputs: dict[str, Any] | None
    """One of `{"json": schema}`, `{"regex": ...}`, `{"grammar": ebnf}`, from whichever
    field asked for it (`response_format`, a forced `tool_choice`, `structured_outputs`,
    `regex`, `ebnf`)."""
    logit_bias: dict[int, float] | None


class RenderedRequest(BaseModel):
    """vLLM's `GenerateRequest`, the answer of its `/v1/chat/completions/render` (one) and
    `/v1/completions/render` (one per prompt): the token ids the worker would see and the
    sampling parameters it would run them with."""

    request_id: str
    token_ids: list[int]
    features: None = None
    """Multimodal features: none on a text-only server."""
    sampling_params: RenderedSamplingParams
    model: str | None
    """As the request named it (None when it named none)."""
    stream: bool
    stream_options: StreamOptions | None
    cache_salt: str | None
    priority: int
    kv_transfer_params: None = None
    """No disaggregated prefill here."""


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, which its clients parse into typed exceptions."""

    error: ErrorInfo
