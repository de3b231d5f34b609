import torch

from engine.cache.namespace import PrefixNamespace
from engine.sampling.sampling_params import SamplingParams
from engine.sched.cache_manager import CacheManager
from engine.sched.req import Admission, Req, ReqStatus
from engine.sched.retract import retract_decode
from testing.radix import simulated_cache, total_size


def running(cache: CacheManager, rid: str, input_len: int, output_len: int) -> Req:
    req = Req(
        rid,
        list(range(input_len)),
        SamplingParams(max_new_tokens=256),
        output_ids=[1] * output_len,
        admission=Admission(PrefixNamespace(rid)),
    )
    cache.match_req(req)
    cache.alloc_row(req)
    seqlen = input_len + output_len
    cache.req_to_token_pool.write(req.kv.req_pool_idx, 0, cache.alloc_slots(seqlen))
    req.kv.allocated_len = seqlen
    cache.commit(req, seqlen)
    req.lifecycle.status = ReqStatus.RUNNING
    return req


def test_retracts_fewest_outputs_then_longest_input_first_and_frees_without_caching():
    cache = simulated_cache(num_slots=48, max_reqs=8)
    reqs = [
        running(cache, "old", 8, 10),
        running(cache, "short-new", 4, 1),
        running(cache, "long-new", 12, 1),
        running(cache, "mid", 6, 5),
    ]
    assert cache.allocator.available_size() == 1

    result = retract_decode(reqs, cache)

    assert [r.rid for r in result.retracted] == ["long-new"]
    assert [r.rid for r in result.kept] == ["old", "short-new", "mid"]
    assert result.aborted is None
    long_new = result.retracted[0]
    assert long_new.lifecycle.status is ReqStatus.WAITING and long_new.kv.req_pool_idx is None
    assert long_new.output_ids == [1] and long_new.lifecycle.num_retractions == 1
    assert total_size(cache.tree_cache) == 0
    cache.check_integrity(result.kept)


def test_keeps_at_least_one_and_aborts_it_with_a_message_when_it_cannot_fit_alone():
    cache = simulated_cache(num_slots=20, max_reqs=4)
    result = retract_decode([running(cache, "a", 16, 4)], cache)
    assert result.kept == [] and result.retracted == [] and result.aborted.rid == "a"
    assert result.aborted.lifecycle.finished_reason.type == "abort"
    assert "cannot hold" in result.aborted.lifecycle.finished_reason.message
    assert cache.allocator.available_size() == 20
    cache.check_integrity()
    assert torch.equal(cache.allocator.free_slots().sort().values, torch.arange(1, 21))
