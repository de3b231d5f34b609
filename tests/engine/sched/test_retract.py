import torch

from engine.cache.radix_cache import RadixCache
from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import Req, ReqStatus
from engine.sched.retract import check_decode_mem, retract_decode


def running(cache: RadixCache, rid: str, input_len: int, output_len: int) -> Req:
    req = Req(
        rid,
        list(range(input_len)),
        SamplingParams(max_new_tokens=256),
        output_ids=[1] * output_len,
        extra_key=rid,
    )
    (row,) = cache.req_to_token_pool.alloc(1)
    seqlen = input_len + output_len
    cache.req_to_token_pool.write(row, 0, cache.token_to_kv_pool_allocator.alloc(seqlen))
    req.req_pool_idx, req.kv_allocated_len, req.kv_committed_len = row, seqlen, seqlen
    req.last_node, req.status = cache.root_node, ReqStatus.RUNNING
    return req


def test_decode_mem_check_evicts_cache_before_anything_else():
    cache = RadixCache.create_simulated(num_slots=10)
    req = running(cache, "a", 6, 0)
    req.kv_committed_len = 6
    cache.cache_finished_req(req)
    cache.token_to_kv_pool_allocator.alloc(4)
    assert check_decode_mem(3, cache)
    assert cache.total_size() < 6


def test_retracts_fewest_outputs_then_longest_input_first_and_frees_without_caching():
    cache = RadixCache.create_simulated(num_slots=48, max_reqs=8)
    reqs = [
        running(cache, "old", 8, 10),
        running(cache, "short-new", 4, 1),
        running(cache, "long-new", 12, 1),
        running(cache, "mid", 6, 5),
    ]
    assert cache.token_to_kv_pool_allocator.available_size() == 1

    result = retract_decode(reqs, cache)

    assert [r.rid for r in result.retracted] == ["long-new"]
    assert [r.rid for r in result.kept] == ["old", "short-new", "mid"]
    assert result.aborted is None
    long_new = result.retracted[0]
    assert long_new.status is ReqStatus.WAITING and long_new.req_pool_idx is None
    assert long_new.output_ids == [1] and long_new.num_retractions == 1
    assert cache.total_size() == 0
    cache.check_integrity(result.kept)


def test_keeps_at_least_one_and_aborts_it_with_a_message_when_it_cannot_fit_alone():
    cache = RadixCache.create_simulated(num_slots=20, max_reqs=4)
    result = retract_decode([running(cache, "a", 16, 4)], cache)
    assert result.kept == [] and result.retracted == [] and result.aborted.rid == "a"
    assert result.aborted.finished_reason.type == "abort"
    assert "cannot hold" in result.aborted.finished_reason.message
    assert cache.token_to_kv_pool_allocator.available_size() == 20
    cache.check_integrity()
    assert torch.equal(
        cache.token_to_kv_pool_allocator.free_slots().sort().values, torch.arange(1, 21)
    )
