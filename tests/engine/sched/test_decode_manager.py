"""Room for the running batch's next decode step over a hybrid model's two pools, where the
sliding-window pool is the short one: the requests' dead SWA slots (behind their windows,
not yet reached by the batched frees) go first, before the cache's live SWA KV and before
any request is retracted; when even they are not enough, retraction frees the SWA pool."""

from __future__ import annotations

import torch

from engine.cache.radix_key import RadixKey
from engine.sampling.sampling_params import SamplingParams
from engine.sched.cache_manager import CacheManager
from engine.sched.decode_manager import DecodeManager
from engine.sched.req import Req
from engine.sched.retract import retract_decode
from engine.sched.stats import SchedulerStats
from testing.radix import simulated_cache

WINDOW = 8
PROMPT, DECODED = 4, 40
"""Each running request's tokens: after 40 decode steps it holds the SWA slots of its last
12 tokens, 5 of them behind its window (fewer than an eviction interval: not yet freed)."""
LIVE, DEAD = 12, 5


def hybrid_cache(swa_slots: int) -> CacheManager:
    """A full pool far larger than the SWA pool: the SWA pool is the binding one."""
    return simulated_cache(
        1024, max_reqs=16, max_context_len=256, swa_slots=swa_slots, sliding_window=WINDOW
    )


def prefilled(cache: CacheManager, rid: str, prompt: list[int]) -> Req:
    """A request admitted (its prefix matched and locked) and its prompt's KV written."""
    req = Req(rid, prompt, SamplingParams(max_new_tokens=256))
    cache.match_req(req)
    cache.lock(req)
    cache.alloc_row(req)
    cache.keep_verified(req, cache.alloc_slots(len(prompt) - len(req.kv.prefix_indices)))
    return req


def decoding(cache: CacheManager, rid: int, decoded: int = DECODED) -> Req:
    """A request that decoded `decoded` tokens, a slot a step, freeing behind its window as
    the scheduler does after each step."""
    req = prefilled(cache, f"r{rid}", [100 * (rid + 1) + i for i in range(PROMPT)])
    for token in range(decoded):
        cache.keep_verified(req, cache.alloc_slots(1))
        req.output_ids.append(token)
        cache.free_out_of_window([req])
    return req


def decode_manager(cache: CacheManager, reqs: list[Req]) -> DecodeManager:
    decode = DecodeManager(256, torch.device("cpu"), cache, SchedulerStats(), 1.0)
    decode.running.add(reqs)
    return decode


def swa_free(cache: CacheManager) -> int:
    assert cache.swa_allocator is not None
    return cache.swa_allocator.swa_available_size()


def test_a_decode_step_short_of_swa_slots_takes_the_requests_dead_ones_and_retracts_none():
    cache = hybrid_cache(swa_slots=3 * LIVE + 40)
    reqs = [decoding(cache, i) for i in range(3)]
    chunked = prefilled(cache, "chunked", list(range(1, 40)))  # the rest, but one slot
    assert swa_free(cache) == 1 < len(reqs)
    decode = decode_manager(cache, reqs)

    assert decode.make_room(resolve_in_flight=lambda: None) is None
    assert decode.running.reqs == reqs and decode.stats.num_retractions == 0
    assert swa_free(cache) == 1 + 3 * DEAD
    assert all(r.kv.swa_evicted_len == r.kv.committed_len + 1 - WINDOW for r in reqs)
    cache.check_integrity([*reqs, chunked])


def test_the_requests_dead_swa_slots_go_before_the_caches_live_swa_kv():
    cache = hybrid_cache(swa_slots=3 * LIVE + 60)
    cached = prefilled(cache, "cached", list(range(1, 21)))
    cache.cache_finished_req(cached)  # its end's window of SWA KV stays in the tree, evictable
    reqs = [decoding(cache, i) for i in range(3)]
    chunked = prefilled(cache, "chunked", list(range(50, 50 + swa_free(cache) - 1)))
    tree = cache.tree_cache
    assert swa_free(cache) == 1 and tree.swa_evictable_size() == WINDOW - 1

    assert decode_manager(cache, reqs).make_room(resolve_in_flight=lambda: None) is None
    assert tree.swa_evictable_size() == WINDOW - 1, "the cache kept its live SWA KV"
    assert len(tree.match_prefix(RadixKey(list(range(1, 21)))).device_indices) == 20
    cache.check_integrity([*reqs, chunked])


def test_retraction_frees_the_swa_pool_when_the_dead_slots_are_not_enough():
    cache = hybrid_cache(swa_slots=LIVE + 7 * 6 + 20)
    long = decoding(cache, 0)
    short = [decoding(cache, i, decoded=2) for i in range(1, 8)]  # inside their windows
    reqs = [long, *short]
    chunked = prefilled(cache, "chunked", list(range(1, swa_free(cache) + 1)))
    assert swa_free(cache) == 0 and cache.full_available_size() > 500
    decode = decode_manager(cache, reqs)

    result = decode.make_room(resolve_in_flight=lambda: None)

    assert result is not None and len(result.retracted) == 1 and result.aborted is None
    assert decode.running.reqs == result.kept == [long, *short[:-1]]
    assert long.kv.swa_evicted_len == long.kv.committed_len + 1 - WINDOW
    assert swa_free(cache) >= len(result.kept)
    cache.check_integrity([*result.kept, chunked])


def test_a_request_the_swa_pool_cannot_hold_alone_is_aborted_naming_that_pool():
    cache = hybrid_cache(swa_slots=40)
    req = decoding(cache, 0)
    cache.free_out_of_window([req], interval=1)
    prefilled(cache, "chunked", list(range(1, swa_free(cache) + 1)))
    assert swa_free(cache) == 0

    result = retract_decode([req], cache)

    assert result.aborted is req and result.kept == []
    message = req.lifecycle.finished_reason.message
    assert "sliding-window KV pool (40 tokens)" in message
    assert "--swa-full-tokens-ratio" in message
