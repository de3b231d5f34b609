"""Retraction: what happens when overcommit overshoots and the next decode step lacks slots.

First the tree gives up unlocked cache; if that is not enough, running requests are sent
back to the queue — those that decoded least (cheapest to redo) and hold the longest
input (frees the most) first. Their KV is freed, not cached: the space is needed now.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.cache.radix_cache import RadixCache
from engine.sched.req import FinishReason, Req, ReqStatus


class RetractResult(NamedTuple):
    kept: list[Req]
    retracted: list[Req]
    aborted: Req | None
    """The last request, finished with an error when even it alone cannot fit."""


def check_decode_mem(num_new_tokens: int, tree_cache: RadixCache) -> bool:
    """Make room for one decode step by evicting cache; True if it fits."""
    allocator = tree_cache.token_to_kv_pool_allocator
    if allocator.available_size() < num_new_tokens:
        tree_cache.evict(num_new_tokens - allocator.available_size())
    return allocator.available_size() >= num_new_tokens


def release_req(req: Req, tree_cache: RadixCache) -> None:
    """Free a request's KV without caching it, and send it back to waiting."""
    tree_cache.cache_finished_req(req, is_insert=False)
    req.is_chunked = False
    req.status = ReqStatus.WAITING


def retract_decode(reqs: list[Req], tree_cache: RadixCache) -> RetractResult:
    """Retract requests until one decode token per survivor fits; keep at least one."""
    order = sorted(reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
    retracted: list[Req] = []
    while not check_decode_mem(len(order), tree_cache):
        if len(order) == 1:
            last = order.pop()
            release_req(last, tree_cache)
            pool = tree_cache.token_to_kv_pool_allocator.size
            last.finish(
                FinishReason(
                    "abort",
                    message=(
                        f"the KV cache ({pool} tokens) cannot hold this request's {last.seqlen + 1} tokens even alone; "
                        "lower max_tokens or raise --max-total-tokens"
                    ),
                )
            )
            return RetractResult([], retracted, last)
        req = order.pop()
        release_req(req, tree_cache)
        req.num_retractions += 1
        retracted.append(req)
    kept_ids = {id(r) for r in order}
    return RetractResult([r for r in reqs if id(r) in kept_ids], retracted, None)
