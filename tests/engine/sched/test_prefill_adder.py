import pytest

from engine.cache.radix_cache import RadixCache
from engine.cache.radix_key import RadixKey
from engine.sampling.sampling_params import SamplingParams
from engine.sched.prefill_adder import AddReqResult, PrefillAdder
from engine.sched.req import Req


def make_adder(
    cache: RadixCache, running=(), ratio=0.5, clip=4096, max_prefill=10_000, chunk=None
) -> PrefillAdder:
    return PrefillAdder(
        cache, cache.token_to_kv_pool_allocator, running, ratio, clip, max_prefill, chunk
    )


def waiting(cache: RadixCache, rid: str, input_len: int, max_new: int, first_token: int = 0) -> Req:
    req = Req(
        rid,
        list(range(first_token, first_token + input_len)),
        SamplingParams(max_new_tokens=max_new),
    )
    req.init_next_round_input(cache)
    return req


def test_running_requests_reserve_their_clipped_remaining_tokens_times_the_ratio():
    cache = RadixCache.create_simulated(num_slots=1000)
    running = [
        Req("r", [1], SamplingParams(max_new_tokens=300), output_ids=[2] * 100),
        Req("huge", [1], SamplingParams(max_new_tokens=100_000)),
    ]
    adder = make_adder(cache, running, ratio=0.5, clip=64)
    assert adder.rem_total_tokens == pytest.approx(1000 - (min(200, 64) + 64) * 0.5)


def test_a_newcomer_must_fit_its_input_and_clipped_max_new_tokens_in_full():
    cache = RadixCache.create_simulated(num_slots=1000)
    adder = make_adder(cache, clip=4096)
    assert adder.add_one_req(waiting(cache, "too-big", 100, 901)) is AddReqResult.NO_TOKEN
    assert adder.add_one_req(waiting(cache, "fits", 100, 900)) is AddReqResult.CONTINUE
    assert adder.rem_total_tokens == 0
    clipped = make_adder(RadixCache.create_simulated(num_slots=1000), clip=64)
    assert (
        clipped.add_one_req(waiting(clipped.tree_cache, "clipped", 100, 100_000))
        is AddReqResult.CONTINUE
    )


def test_locking_the_matched_prefix_is_rechecked_against_the_budget():
    """The only room is the request's own cached prefix: budgeted as evictable, it stops
    counting once locked, and the request no longer fits."""
    cache = RadixCache.create_simulated(num_slots=100)
    prompt = list(range(60))
    slots = cache.token_to_kv_pool_allocator.alloc(60)
    cache.insert(RadixKey(prompt), slots)
    req = waiting(cache, "r", 0, 41)
    req.origin_input_ids = prompt + [7]
    req.init_next_round_input(cache)
    assert (len(req.prefix_indices), req.extend_input_len) == (60, 1)
    adder = make_adder(cache)
    assert adder.rem_total_tokens == 100  # 40 free + 60 evictable
    assert adder.add_one_req(req) is AddReqResult.NO_TOKEN
    assert cache.protected_size() == 0, "a rejected request must not keep its lock"

    fits = waiting(cache, "fits", 0, 39)
    fits.origin_input_ids = prompt + [7]
    fits.init_next_round_input(cache)
    assert adder.add_one_req(fits) is AddReqResult.CONTINUE
    assert cache.protected_size() == 60


def test_prefill_token_budget_stops_the_round_but_admits_one_oversized_request():
    cache = RadixCache.create_simulated(num_slots=10_000)
    adder = make_adder(cache, max_prefill=100)
    assert adder.add_one_req(waiting(cache, "big", 150, 8)) is AddReqResult.CONTINUE
    assert adder.add_one_req(waiting(cache, "next", 10, 8, first_token=500)) is AddReqResult.OTHER


def test_chunked_prefill_truncates_to_the_chunk_and_reserves_no_output_yet():
    cache = RadixCache.create_simulated(num_slots=10_000)
    adder = make_adder(cache, chunk=64)
    req = waiting(cache, "long", 200, 16)
    assert adder.add_one_req(req) is AddReqResult.CONTINUE
    assert (req.extend_input_len, req.is_chunked, adder.new_chunked_req) == (64, True, req)
    assert adder.rem_chunk_tokens == 0 and adder.budget_exhausted()
    assert adder.rem_total_token_offset == 64
