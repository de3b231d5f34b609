"""Retraction: what happens when overcommit overshoots and the next decode step lacks slots.

First the running requests give up their dead sliding-window slots and the cache its
unlocked ones (`DecodeManager.has_room`); if that is not enough, running requests are sent
back to the queue — those that decoded least (cheapest to redo) and hold the longest input
(frees the most) first. Their KV is freed, not cached: the space is needed now.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.sched.cache_manager import CacheManager
from engine.sched.req import FinishReason, Req, ReqStatus


class RetractResult(NamedTuple):
    kept: list[Req]
    retracted: list[Req]
    aborted: Req | None
    """The last request, finished with an error when even it alone cannot fit."""


def release_req(req: Req, cache_manager: CacheManager) -> None:
    """Free a request's KV without caching it, and send it back to waiting."""
    cache_manager.free_req(req)
    req.prefill.is_chunked = False
    req.lifecycle.status = ReqStatus.WAITING


def retract_decode(reqs: list[Req], cache_manager: CacheManager) -> RetractResult:
    """Retract requests until one decode token per survivor fits; keep at least one."""
    order = sorted(reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
    retracted: list[Req] = []
    while not cache_manager.make_room(len(order)):
        if len(order) == 1:
            last = order.pop()
            reason = cannot_fit_alone(last, cache_manager)
            release_req(last, cache_manager)
            last.finish(reason)
            return RetractResult([], retracted, last)
        req = order.pop()
        release_req(req, cache_manager)
        req.lifecycle.num_retractions += 1
        retracted.append(req)
    kept_ids = {id(r) for r in order}
    return RetractResult([r for r in reqs if id(r) in kept_ids], retracted, None)


def cannot_fit_alone(req: Req, cache_manager: CacheManager) -> FinishReason:
    """The abort of the last running request when its next token has no slot, naming the
    pool that is short: the (full) KV cache, or else a hybrid model's SWA pool."""
    swa = cache_manager.swa_allocator
    if swa is not None and cache_manager.full_available_size() > 0:
        message = (
            f"the sliding-window KV pool ({swa.size_swa} tokens) has no slot for this "
            "request's next token even alone; raise --max-total-tokens or "
            "--swa-full-tokens-ratio"
        )
    else:
        message = (
            f"the KV cache ({cache_manager.allocator.size} tokens) cannot hold this request's "
            f"{req.seqlen + 1} tokens even alone; lower max_tokens or raise --max-total-tokens"
        )
    return FinishReason("abort", message=message)
