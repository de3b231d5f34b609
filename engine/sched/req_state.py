"""The parts of a request's state that one manager each owns, as small typed objects on
the `Req`: what ends it (set on submission), its prefill progress (`PrefillAdder`,
`CacheManager`, `PrefillManager`), its KV (`CacheManager`), its grammar (`GrammarQueue`,
then `OutputProcessor`), and what the one reader of its output takes besides the ids (its
logprobs, from `OutputProcessor`) with where that reader stands.
Its drafting state is speculative decoding's
(`engine.speculative.draft_state.DraftState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from engine.cache.base_prefix_cache import CacheHandle
    from engine.grammar import GrammarMatcher, PendingGrammar, ReasoningGrammarMatcher
    from engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopCriteria:
    """What can end a request, fixed on submission so that the per-token check is one set
    lookup and a plain decode takes the scheduler's short path."""

    stop_ids: frozenset[int] = frozenset()
    """The token ids that end it: its `stop_token_ids`, and the model's EOS unless
    `ignore_eos`."""
    plain_decode: bool = False
    """No logprobs, grammar or stop strings: only a stop token or the length can end a
    decode step of it."""

    @classmethod
    def of(cls, params: SamplingParams, eos_token_ids: frozenset[int]) -> StopCriteria:
        return cls(
            frozenset(params.stop_token_ids)
            | (frozenset() if params.ignore_eos else eos_token_ids),
            not (params.logprobs or params.stop or params.grammar is not None),
        )


@dataclass
class PrefillState:
    """A request's prefill progress: `PrefillAdder` sizes this round's (`CacheManager` sets
    it from the radix hit), `PrefillManager` records the first admission's hit."""

    extend_input_len: int = 0
    """Tokens this round's prefill computes (after the radix hit; truncated when chunked)."""
    is_chunked: bool = False
    """Its prefill was cut by --chunked-prefill-size and continues next round."""
    cached_tokens: int | None = None
    """Radix hit at first admission (None until admitted), reported as `cached_tokens`."""
    full_match_len: int = 0
    """Tokens of the last match whose full-attention KV the cache held (`MatchResult`): a
    hybrid model's hit may stop short of them, where its window's SWA KV went."""


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
    swa_evicted_len: int = 0
    """Hybrid models: the request's own tokens before this position (from
    `len(prefix_indices)` on) have had their SWA slots freed: no query sees them any more."""


@dataclass
class GrammarState:
    """A request's grammar: the compile it waits for (`GrammarQueue`), then the matcher that
    masks each next token and accepts each sampled one (`OutputProcessor`)."""

    pending: PendingGrammar | None = None
    matcher: GrammarMatcher | ReasoningGrammarMatcher | None = None
    library: str = ""
    """The library that serves it (`--grammar-backend`, or auto's choice), once compiled."""


class OutputRead(NamedTuple):
    """A read of a request's output (`Req.read_output`)."""

    start: int
    """The first output index the read returns."""
    rollback: int
    """How many ids returned before it replaces: they start at `start` too."""


@dataclass
class OutputState:
    """What the one reader of a request's output (the worker, or the offline stream) takes
    besides the ids, and where it stands: `OutputProcessor` appends the logprobs, where the
    request asks for them, and records a jump-forward's rollback; `take` moves the reader on."""

    token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    """(logprob, token id) per output token, when `sampling_params.logprobs`."""
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    """The `top_logprobs_num` likeliest (logprob, token id) per output token."""
    prompt_logprobs: list[float | None] = field(default_factory=list)
    """Per prompt position from `logprob_start_len` on, the logprob of that prompt token
    given those before it (None at position 0, which nothing predicts). Grows chunk by chunk
    and is complete once the prefill is: see `Req.prompt_logprobs_pending`."""
    prompt_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    """The `prompt_top_logprobs_num` likeliest (logprob, token id) at each of those
    positions ([] at position 0); empty when that number is 0."""
    read: int = 0
    """Output ids the reader has taken."""
    rollback: int = 0
    """Output ids a jump-forward replaced (re-encoded with the forced text) since the
    output was last read."""

    def take(self, output_len: int) -> OutputRead:
        """What of an output of `output_len` ids is new since the last read: the ids from
        `start` on, the first `rollback` of which replace the last ids the previous reads
        returned (a jump-forward re-encoded them; never more than were read)."""
        rollback = min(self.rollback, self.read)
        start = self.read - rollback
        self.rollback = 0
        self.read = output_len
        return OutputRead(start, rollback)
