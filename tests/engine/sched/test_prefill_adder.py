import pytest

from engine.cache.radix_key import RadixKey
from engine.constants import SWA_EVICTION_INTERVAL as INTERVAL
from engine.sampling.sampling_params import SamplingParams
from engine.sched.cache_manager import CacheManager
from engine.sched.prefill_adder import AddReqResult, PrefillAdder
from engine.sched.req import Req
from testing.radix import simulated_cache


def make_adder(
    cache: CacheManager, running=(), ratio=0.5, clip=4096, max_prefill=10_000, chunk=None
) -> PrefillAdder:
    return PrefillAdder(cache, running, ratio, clip, max_prefill, chunk)


def waiting(
    cache: CacheManager, rid: str, input_len: int, max_new: int, first_token: int = 0
) -> Req:
    req = Req(
        rid,
        list(range(first_token, first_token + input_len)),
        SamplingParams(max_new_tokens=max_new),
    )
    cache.match_req(req)
    return req


def test_running_requests_reserve_their_clipped_remaining_tokens_times_the_ratio():
    cache = simulated_cache(num_slots=1000)
    running = [
        Req("r", [1], SamplingParams(max_new_tokens=300), output_ids=[2] * 100),
        Req("huge", [1], SamplingParams(max_new_tokens=100_000)),
    ]
    adder = make_adder(cache, running, ratio=0.5, clip=64)
    assert adder.rem_total_tokens == pytest.approx(1000 - (min(200, 64) + 64) * 0.5)


def test_a_newcomer_must_fit_its_input_and_clipped_max_new_tokens_in_full():
    cache = simulated_cache(num_slots=1000)
    adder = make_adder(cache, clip=4096)
    assert adder.add_one_req(waiting(cache, "too-big", 100, 901)) is AddReqResult.NO_TOKEN
    assert adder.add_one_req(waiting(cache, "fits", 100, 900)) is AddReqResult.CONTINUE
    assert adder.rem_total_tokens == 0
    clipped = make_adder(simulated_cache(num_slots=1000), clip=64)
    assert (
        clipped.add_one_req(waiting(clipped.cache_manager, "clipped", 100, 100_000))
        is AddReqResult.CONTINUE
    )


def test_locking_the_matched_prefix_is_rechecked_against_the_budget():
    """The only room is the request's own cached prefix: budgeted as evictable, it stops
    counting once locked, and the request no longer fits."""
    cache = simulated_cache(num_slots=100)
    prompt = list(range(60))
    slots = cache.allocator.alloc(60)
    cache.tree_cache.insert(RadixKey(prompt), slots)
    req = waiting(cache, "r", 0, 41)
    req.origin_input_ids = prompt + [7]
    cache.match_req(req)
    assert (len(req.kv.prefix_indices), req.prefill.extend_input_len) == (60, 1)
    adder = make_adder(cache)
    assert adder.rem_total_tokens == 100  # 40 free + 60 evictable
    assert adder.add_one_req(req) is AddReqResult.NO_TOKEN
    assert cache.tree_cache.protected_size() == 0, "a rejected request must not keep its lock"

    fits = waiting(cache, "fits", 0, 39)
    fits.origin_input_ids = prompt + [7]
    cache.match_req(fits)
    assert adder.add_one_req(fits) is AddReqResult.CONTINUE
    assert cache.tree_cache.protected_size() == 60


def test_prefill_token_budget_stops_the_round_but_admits_one_oversized_request():
    cache = simulated_cache(num_slots=10_000)
    adder = make_adder(cache, max_prefill=100)
    assert adder.add_one_req(waiting(cache, "big", 150, 8)) is AddReqResult.CONTINUE
    assert adder.add_one_req(waiting(cache, "next", 10, 8, first_token=500)) is AddReqResult.OTHER


def test_chunked_prefill_truncates_to_the_chunk_and_reserves_no_output_yet():
    cache = simulated_cache(num_slots=10_000)
    adder = make_adder(cache, chunk=64)
    req = waiting(cache, "long", 200, 16)
    assert adder.add_one_req(req) is AddReqResult.CONTINUE
    assert (req.prefill.extend_input_len, req.prefill.is_chunked, adder.new_chunked_req) == (
        64,
        True,
        req,
    )
    assert adder.rem_chunk_tokens == 0 and adder.budget_exhausted()
    assert adder.rem_total_token_offset == 64


def test_a_hybrid_models_swa_pool_is_a_budget_of_its_own():
    """1000 full slots and 100 SWA slots, a window of 8: a request holds SWA slots for its
    prompt and a window and an eviction interval of its output at most, so a long output
    fits the small pool, and a long prompt does not, however roomy the full pool."""
    cache = simulated_cache(num_slots=1000, swa_slots=100, sliding_window=8)
    adder = make_adder(cache)
    assert adder.add_one_req(waiting(cache, "long-output", 10, 800)) is AddReqResult.CONTINUE
    assert adder.rem_total_tokens == 1000 - 810
    assert adder.rem_swa_tokens == 100 - (10 + 8 + INTERVAL)
    prompt_len = 100 - (10 + 8 + INTERVAL) - 8 - INTERVAL + 1
    too_long = waiting(cache, "long-prompt", prompt_len, 8 + INTERVAL, first_token=5000)
    assert adder.add_one_req(too_long) is AddReqResult.NO_TOKEN
    fits = waiting(cache, "fits", prompt_len - 1, 8 + INTERVAL, first_token=6000)
    assert adder.add_one_req(fits) is AddReqResult.CONTINUE
    assert adder.rem_swa_tokens == 0 and adder.budget_exhausted()


def retracted(cache: CacheManager, rid: str, input_len: int, output_len: int) -> Req:
    """A request sent back after decoding `output_len` tokens: it prefills them again."""
    req = waiting(cache, rid, input_len, 300)
    req.output_ids = [7] * output_len
    cache.match_req(req)
    return req


def test_a_retracted_request_reserves_only_the_tokens_it_may_still_generate():
    """Its 141 generated tokens are prefilled again: they count in its prompt, and only the
    59 of max_new_tokens left are reserved (200 more would never fit this pool)."""
    cache = simulated_cache(num_slots=300, max_context_len=512)
    req = retracted(cache, "back", 10, 141)
    req.sampling_params.max_new_tokens = 200
    adder = make_adder(cache)
    assert adder.add_one_req(req) is AddReqResult.CONTINUE
    assert adder.rem_total_tokens == 300 - (151 + 59)


def prefill_piece(cache: CacheManager, req: Req) -> None:
    """What the batch of an admitted piece does to the pools: its slots, written, then the
    chunk inserted into the tree (the window before its end locked)."""
    if req.kv.req_pool_idx is None:
        cache.alloc_row(req)
    cache.keep_verified(req, cache.alloc_slots(req.prefill.extend_input_len))
    cache.cache_unfinished_req(req)


def test_a_prefill_longer_than_the_swa_pool_goes_in_pieces_the_swa_budget_holds():
    """A retracted request's 10 prompt and 240 output tokens outgrow a 100-slot SWA pool:
    it prefills 100 of them, then what the tree's evictable SWA KV makes room for."""
    cache = simulated_cache(num_slots=1000, max_context_len=512, swa_slots=100, sliding_window=8)
    req = retracted(cache, "back", 10, 240)
    adder = make_adder(cache)
    assert adder.add_one_req(req) is AddReqResult.CONTINUE
    assert (req.prefill.extend_input_len, req.prefill.is_chunked) == (100, True)
    assert adder.new_chunked_req is req and adder.rem_swa_tokens == 0
    prefill_piece(cache, req)

    adder = make_adder(cache)
    adder.add_chunked_req(req)
    assert adder.can_run_list == [req] and req.prefill.extend_input_len == 100 - 7
    assert req.prefill.is_chunked and adder.new_chunked_req is req
    cache.check_integrity([req])


def test_a_chunk_the_swa_budget_holds_none_of_waits_and_stays_the_chunked_request():
    cache = simulated_cache(num_slots=1000, max_context_len=512, swa_slots=100, sliding_window=8)
    req = retracted(cache, "back", 10, 240)
    make_adder(cache).add_one_req(req)
    prefill_piece(cache, req)
    # Three decodes reserve a window and an interval of SWA slots each: more than is left.
    decoding = [Req(f"d{i}", [1], SamplingParams(max_new_tokens=100)) for i in range(3)]

    adder = make_adder(cache, running=decoding, ratio=1.0)
    adder.add_chunked_req(req)

    assert adder.rem_swa_tokens <= 0
    assert adder.can_run_list == [] and adder.new_chunked_req is req
