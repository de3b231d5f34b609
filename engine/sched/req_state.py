"""The parts of a request's state that one manager each owns, as small typed objects on
the `Req`: its KV (`CacheManager`), its logprobs (`OutputProcessor`) and its grammar
(`GrammarQueue`, then `OutputProcessor`). Its drafting state is speculative decoding's
(`engine.speculative.draft_state.DraftState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.cache.base_prefix_cache import CacheHandle
    from engine.grammar import GrammarMatcher, PendingGrammar, ReasoningGrammarMatcher


@dataclass
class KVState:
    """A request's row of `req_to_token`, its slots and its lock on the prefix cache,
    written by the scheduler's `CacheManager` alone (which documents what each owns)."""

    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: CacheHandle | None = None
    allocated_len: int = 0
    committed_len: int = 0
    """The leading tokens whose K/V has actually been written."""


@dataclass
class LogprobState:
    """A request's logprobs so far, where it asks for them: `OutputProcessor` appends each
    batch's, the output's reader takes them."""

    output_token: list[tuple[float, int]] = field(default_factory=list)
    """(logprob, token id) per output token, when `sampling_params.logprobs`."""
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    """The `top_logprobs_num` likeliest (logprob, token id) per output token."""
    input_token: list[float | None] = field(default_factory=list)
    """Per prompt position from `logprob_start_len` on, the logprob of that prompt token
    given those before it (None at position 0, which nothing predicts). Grows chunk by chunk
    and is complete once the prefill is: see `Req.prompt_logprobs_pending`."""
    input_top: list[list[tuple[float, int]]] = field(default_factory=list)
    """The `prompt_top_logprobs_num` likeliest (logprob, token id) at each of those
    positions ([] at position 0); empty when that number is 0."""


@dataclass
class GrammarState:
    """A request's grammar: the compile it waits for (`GrammarQueue`), then the matcher that
    masks each next token and accepts each sampled one (`OutputProcessor`)."""

    pending: PendingGrammar | None = None
    matcher: GrammarMatcher | ReasoningGrammarMatcher | None = None
