"""What the offline Engine returns: one result per prompt, or a stream of chunks.

Typed, not JSON: whoever serves a result over the wire (the HTTP layer's `ChoiceOutput`)
converts it there."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sched.req import FinishReason


@dataclass(frozen=True)
class GenerateMeta:
    """A finished request's counts and why it stopped."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens served from the radix cache at first admission."""
    finish_reason: FinishReason | None
    output_token_logprobs: list[tuple[float, int]] | None = None
    """(logprob, token id) per output token; None unless `logprobs` was asked."""
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    """The likeliest (logprob, token id) per output token; None unless `logprobs` and
    `top_logprobs_num` were asked."""
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    """(logprob, token id) per prompt position from `logprob_start_len` on; the logprob is
    None at position 0, which nothing predicts. None unless `logprob_start_len` >= 0, or
    when the request ended before its prefill did (aborted)."""
    input_top_logprobs: list[list[tuple[float, int]]] | None = None
    """The likeliest (logprob, token id) at each of those positions ([] at position 0);
    None unless `logprob_start_len` >= 0 and `prompt_top_logprobs_num` were asked."""
    spec_verify_ct: int = 0
    """Speculative verify passes the request took part in (SGLang's name; 0 when off)."""
    spec_accept_length: float = 0.0
    """Its tokens per verify pass: 1 + the drafted tokens accepted per pass (0 without any)."""


@dataclass(frozen=True)
class GenerateResult:
    """One prompt's output: `text` is decoded with stop strings and a matched stop token
    trimmed; `output_ids` holds every generated id."""

    text: str
    output_ids: list[int]
    meta: GenerateMeta


@dataclass(frozen=True)
class StreamChunk:
    """What one step of `generate_stream` adds. With jump-forward, `rollback` says how many
    ids already yielded were re-encoded: `output_ids` replaces them (the text only ever
    grows). Only the last chunk carries `meta`."""

    text: str
    output_ids: list[int]
    rollback: int = 0
    meta: GenerateMeta | None = None
