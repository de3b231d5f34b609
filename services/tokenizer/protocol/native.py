"""The wire models of SGLang's native `/generate` and vLLM's `/tokenize` and
`/detokenize`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    model_validator,
)

from services.tokenizer.protocol.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from services.tokenizer.protocol.common import (
    TEXT_SCHEMA,
    TOKEN_IDS_SCHEMA,
    StrictModel,
    prompt_batch,
)


class TokenizeCompletionRequest(StrictModel):
    """vLLM's `/tokenize` for a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(StrictModel):
    """vLLM's `/tokenize` for a conversation: the ids chat would send to the worker."""

    model: str | None = None
    messages: list[ChatCompletionMessageParam] = Field(min_length=1)
    tools: list[ChatCompletionToolParam] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class GenerateRequest(StrictModel):
    """SGLang's native `/generate`: `sampling_params` uses the engine's own names."""

    model_config = ConfigDict(
        strict=True,
        extra="ignore",
        json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]},
    )

    text: Annotated[
        Annotated[list[str], BeforeValidator(prompt_batch)] | None,
        WithJsonSchema(
            {"anyOf": [TEXT_SCHEMA, {"type": "array", "items": TEXT_SCHEMA, "minItems": 1}]}
        ),
    ] = None
    """One text or a batch; held as a batch."""
    input_ids: Annotated[
        Annotated[list[list[int]], BeforeValidator(prompt_batch)] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    TOKEN_IDS_SCHEMA,
                    {"type": "array", "items": TOKEN_IDS_SCHEMA, "minItems": 1},
                ]
            }
        ),
    ] = None
    """One token-id list or a batch; held as a batch."""
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    json_schema_best_effort: bool = False
    """As chat's: serve `sampling_params.json_schema` even with keywords it cannot enforce."""
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    """With `return_logprob`: also the prompt tokens' logprobs from this position on
    (-1: none), in `meta_info.input_token_logprobs`."""
    lora_path: str | None = None
    """SGLang's name for the LoRA adapter to serve every prompt with (its name; None: the base
    model)."""
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


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
