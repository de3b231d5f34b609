"""`/v1/completions`' wire models: a batch of prompts in; texts, legacy logprobs and
vLLM's prompt logprobs out (shared fields: `protocol.common`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from services.tokenizer.protocol.common import (
    ChoicesEnvelope,
    FinishReasonName,
    Logprob,
    PromptBatch,
    Refused,
    SamplingRequest,
    UsageInfo,
)


class CompletionRequest(SamplingRequest):
    prompt: PromptBatch
    """A text, a list of texts, a list of token ids or a list of token-id lists; always
    held as a batch (a list of texts or a list of token-id lists)."""
    logprobs: int | None = None
    """How many top alternatives to return per token; 0 returns the sampled token's only."""
    echo: bool = False
    """Prepend the prompt to each choice's text (and its tokens' logprobs, when asked)."""
    prompt_logprobs: int | None = None
    """vLLM's extra: the logprob of every prompt token and its k likeliest alternatives."""
    suffix: Refused = None
    prompt_embeds: Refused = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Logprob | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, Logprob] | None] = Field(default_factory=list)


class VllmLogprob(BaseModel):
    logprob: Logprob
    rank: int | None = None
    """Not computed: the rank would need a sort of the vocabulary per position."""
    decoded_token: str


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    prompt_logprobs: list[dict[str, VllmLogprob] | None] | None = None
    """vLLM's, when asked."""


class CompletionResponse(ChoicesEnvelope[CompletionResponseChoice]):
    object: Literal["text_completion"] = "text_completion"
    usage: UsageInfo


class CompletionChunk(ChoicesEnvelope[CompletionResponseChoice]):
    object: Literal["text_completion"] = "text_completion"
