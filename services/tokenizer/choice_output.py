"""A choice as the tokenizer service holds it once detokenized: its tokens' logprobs as a
response shows them, and the finished choice every API shapes its answer from.

Choices are numbered as OpenAI numbers them: with `p` prompts and `n` samples each, choice
`i * n + j` is sample `j` of prompt `i` (chat has one prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.io_struct import FinishReason

LOGPROB_FLOOR = -9999.0
"""The least logprob a response shows (vLLM's floor): a token the grammar or a bias forbade
has -inf, which the sampler sends as float32's minimum, and neither is a number a JSON
client expects."""

REQUESTED_ABORT_STATUS = 499
"""The status of a request aborted because it was asked to (`/abort_request`): nginx's
"client closed request", never a server error. Such a stream ends with finish reason
"abort" (vLLM's name); an answer not streamed is this status with an error body."""


def shown_logprob(value: float) -> float:
    """`value`, floored at `LOGPROB_FLOOR`; a NaN (which compares false) is floored too."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def shown_or_none(value: float | None) -> float | None:
    """An echoed prompt's first token has no logprob: it stays null."""
    return None if value is None else shown_logprob(value)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob and its most likely alternatives, with their text. A prompt's
    first token has none (None): nothing comes before it to predict it."""

    token_id: int
    token: str
    logprob: float | None
    top_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ChoiceOutput:
    """One finished choice."""

    text: str
    output_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    """Present only when the request asked for logprobs."""
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """Per prompt position from `logprob_start_len`; present only when asked."""
    spec_verify_ct: int | None = None
    """Speculative verify passes it took part in; None without speculative decoding."""
    spec_accept_length: float | None = None
    """Its tokens per verify pass (1 + drafts accepted per pass); None likewise."""
