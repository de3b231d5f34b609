"""Logprobs from the wire as the API shows them: each token id with its text. The worker
sends ids and values only; the texts are decoded here, in one batched decode per output,
and a long prompt's in a thread (`decoded`), off the event loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.io_struct import BatchStrOutput
from services.tokenizer.choice_output import TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

INLINE_LOGPROB_IDS = 256
"""Prompt logprobs naming up to this many token ids (positions and their alternatives) are
decoded on the event loop; more go to a thread, whose hop costs less than the loop time a
long request's decoding would hold (docs/benchmarks/host.md, "The tokenizer's inline
thresholds")."""


@dataclass(frozen=True)
class RawLogprobs:
    """Logprobs as the wire brings them: per position a token id, its logprob, and the ids
    and logprobs of its alternatives."""

    token_ids: Sequence[int]
    values: Sequence[float | None]
    top_vals: Sequence[Sequence[float]]
    top_ids: Sequence[Sequence[int]]


def output_logprobs(
    tokenizer: PreTrainedTokenizerBase | None, batch: BatchStrOutput, i: int
) -> tuple[TokenLogprob, ...]:
    """The logprobs of the tokens batch row `i` brings, with their texts."""
    values = batch.output_token_logprobs_val[i] if batch.output_token_logprobs_val else []
    if not values:
        return ()
    top_vals = batch.output_top_logprobs_val[i] if batch.output_top_logprobs_val else []
    top_ids = batch.output_top_logprobs_idx[i] if batch.output_top_logprobs_idx else []
    return token_logprobs(tokenizer, RawLogprobs(batch.output_ids[i], values, top_vals, top_ids))


def prompt_logprobs(
    batch: BatchStrOutput, i: int, prompt_ids: dict[str, list[int]]
) -> RawLogprobs | None:
    """The prompt logprobs batch row `i` brings, paired with its prompt ids kept at
    submission (`prompt_ids`, rid → ids; dropped now: they come once), still without their
    texts (`decoded` adds them)."""
    values = batch.input_token_logprobs_val[i] if batch.input_token_logprobs_val else []
    if not values:
        return None
    ids = prompt_ids.pop(batch.rids[i], [])
    if len(values) != len(ids):
        logger.error(
            "dropped the prompt logprobs of %s: %d values for its %d prompt tokens",
            batch.rids[i],
            len(values),
            len(ids),
        )
        return None
    top_vals = batch.input_top_logprobs_val[i] if batch.input_top_logprobs_val else []
    top_ids = batch.input_top_logprobs_idx[i] if batch.input_top_logprobs_idx else []
    return RawLogprobs(ids, values, top_vals, top_ids)


async def decoded(
    tokenizer: PreTrainedTokenizerBase | None, raw: RawLogprobs
) -> tuple[TokenLogprob, ...]:
    """`raw` with its tokens' texts; in a thread when it is long (a long prompt's logprobs are
    millions of objects at 20 alternatives per position), so the event loop keeps serving
    probes, streams and heartbeats meanwhile."""
    if len(raw.token_ids) + sum(map(len, raw.top_ids)) <= INLINE_LOGPROB_IDS:
        return token_logprobs(tokenizer, raw)
    return await asyncio.to_thread(token_logprobs, tokenizer, raw)


def token_logprobs(
    tokenizer: PreTrainedTokenizerBase | None, raw: RawLogprobs
) -> tuple[TokenLogprob, ...]:
    """A TokenLogprob per token with its alternatives, every text from one decode."""
    text = _texts(tokenizer, [*raw.token_ids, *(t for ids in raw.top_ids for t in ids)])
    tops = [
        tuple(TokenLogprob(t, text[t], lp) for lp, t in zip(vals, ids))
        for vals, ids in zip(raw.top_vals, raw.top_ids)
    ] or [()] * len(raw.token_ids)
    return tuple(
        TokenLogprob(token_id, text[token_id], value, top)
        for token_id, value, top in zip(raw.token_ids, raw.values, tops)
    )


def _texts(tokenizer: PreTrainedTokenizerBase | None, token_ids: Sequence[int]) -> dict[int, str]:
    """Each distinct token's text alone (what `decode([id])` gives), in one batched decode: a
    prompt's logprobs name thousands of tokens. Without a tokenizer a token's text is its id."""
    distinct = list(dict.fromkeys(token_ids))
    if tokenizer is None:
        return {t: str(t) for t in distinct}
    return dict(zip(distinct, tokenizer.batch_decode([[t] for t in distinct])))
