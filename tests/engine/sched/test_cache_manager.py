"""The owner of requests' KV: what finishing, continuing and freeing a request do to its
row, its slots and the tree, and the integrity check over all three."""

import pytest
import torch

from engine.cache.radix_key import RadixKey
from engine.constants import SWA_EVICTION_INTERVAL as INTERVAL
from engine.sched.cache_manager import CacheManager
from engine.sched.req import Req
from testing.radix import insert_fresh, simulated_cache, total_size


def admit(cache: CacheManager, req: Req, extra_slots: int = 0) -> None:
    """What admission and the first batch do: match, lock, take a row starting with the
    prefix, then slots for the rest of the prompt and `extra_slots` more."""
    cache.match_req(req)
    cache.lock(req)
    cache.alloc_row(req)
    start = len(req.kv.prefix_indices)
    new = cache.alloc_slots(len(req.origin_input_ids) - start + extra_slots)
    cache.req_to_token_pool.write(req.kv.req_pool_idx, start, new)
    req.kv.allocated_len = start + len(new)


def row_slots(cache: CacheManager, req: Req, n: int) -> list[int]:
    return cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].tolist()


def test_two_requests_with_one_prompt_end_with_one_copy_of_its_slots():
    cache = simulated_cache()
    prompt = list(range(100, 110))
    a, b = Req("a", prompt, output_ids=[7]), Req("b", prompt, output_ids=[8])
    admit(cache, a)
    admit(cache, b)  # admitted together: neither sees the other's KV yet
    for req in (a, b):
        cache.commit(req, len(prompt))
    a_slots = row_slots(cache, a, len(prompt))
    cache.check_integrity([a, b])

    cache.cache_finished_req(a)
    cache.check_integrity([b])
    cache.cache_finished_req(b)

    assert total_size(cache.tree_cache) == len(prompt)
    assert cache.tree_cache.match_prefix(RadixKey(prompt)).device_indices.tolist() == a_slots
    assert cache.allocator.available_size() == 64 - len(prompt)
    cache.check_integrity()


def test_unfinished_req_is_repointed_at_the_shared_copy_and_locks_it():
    cache = simulated_cache()
    prompt = list(range(100, 110))
    a, b = Req("a", prompt), Req("b", prompt)
    admit(cache, a)
    admit(cache, b)
    for req in (a, b):
        cache.commit(req, len(prompt))
    a_slots = row_slots(cache, a, len(prompt))

    cache.cache_unfinished_req(a)
    cache.cache_unfinished_req(b)

    assert row_slots(cache, b, len(prompt)) == a_slots
    assert b.kv.prefix_indices.tolist() == a_slots and b.kv.last_node is a.kv.last_node
    assert a.kv.last_node.lock_ref == 2
    tree = cache.tree_cache
    assert (tree.evictable_size(), tree.protected_size()) == (0, len(prompt))
    cache.check_integrity([a, b])


def test_finished_req_inserts_input_and_all_but_the_last_output_token():
    cache = simulated_cache()
    req = Req("r", [1, 2, 3, 4, 5], output_ids=[6, 7, 8])
    admit(cache, req, extra_slots=3)  # slots for 6, 7 and the never-forwarded 8
    cache.commit(req, 7)
    slots = row_slots(cache, req, 8)

    cache.cache_finished_req(req)

    tree = cache.tree_cache
    assert total_size(tree) == 7
    assert (
        tree.match_prefix(RadixKey([1, 2, 3, 4, 5, 6, 7, 8])).device_indices.tolist() == slots[:7]
    )
    assert slots[7] in cache.allocator.free_slots().tolist()
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size
    assert (req.kv.req_pool_idx, req.kv.last_node, req.kv.allocated_len) == (None, None, 0)
    cache.check_integrity()


def test_chunked_prefill_self_inserts_do_not_count_hits():
    cache = simulated_cache(eviction_policy="lfu")
    prompt = list(range(200, 212))
    req = Req("long", prompt)
    cache.match_req(req)
    cache.alloc_row(req)
    for start in range(0, 12, 4):  # three chunks of 4 tokens
        cache.req_to_token_pool.write(req.kv.req_pool_idx, start, cache.alloc_slots(4))
        req.kv.allocated_len = start + 4
        cache.commit(req, 4)
        cache.cache_unfinished_req(req)
        cache.check_integrity([req])
        assert len(req.kv.prefix_indices) == start + 4

    assert all(node.hit_count == 0 for node in cache.tree_cache._nodes())
    other = Req("other", prompt + [1])
    admit(cache, other)
    assert len(other.kv.prefix_indices) == 12
    cache.check_integrity([req, other])


def test_without_the_radix_cache_nothing_is_shared_and_a_finish_frees_everything():
    cache = simulated_cache(disable_radix_cache=True)
    tree = cache.tree_cache
    insert_fresh(cache, [1, 2, 3])
    assert total_size(tree) == 0
    assert tree.insert(RadixKey([4, 5]), torch.tensor([1, 2])) == (0, 0)
    req = Req("r", [1, 2, 3], output_ids=[4])
    admit(cache, req, extra_slots=1)
    assert req.kv.prefix_indices.numel() == 0 and req.kv.last_node.lock_ref == 0  # pins nothing
    cache.commit(req, 3)
    cache.cache_unfinished_req(req)
    assert req.kv.prefix_indices.numel() == 0 and req.kv.committed_len == 3
    cache.check_integrity([req])

    cache.cache_finished_req(req)

    assert tree.evict(10) == 0
    assert cache.allocator.available_size() == 64
    cache.check_integrity()


def test_freeing_without_insert_frees_owned_slots_and_unlocks_the_prefix():
    cache = simulated_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    req = Req("retracted", [1, 2, 3, 4, 5, 6], output_ids=[7])
    admit(cache, req, extra_slots=1)
    tree = cache.tree_cache
    assert len(req.kv.prefix_indices) == 4 and tree.protected_size() == 4
    cache.commit(req, 2)  # the prompt after its cached prefix

    cache.free_req(req)

    assert total_size(tree) == 4 and tree.protected_size() == 0
    assert cache.allocator.available_size() == 64 - 4
    cache.check_integrity()


def test_make_room_evicts_cache_before_anything_else():
    cache = simulated_cache(num_slots=10)
    insert_fresh(cache, list(range(6)))
    cache.allocator.alloc(4)
    assert cache.make_room(3)
    assert total_size(cache.tree_cache) < 6
    assert not cache.make_room(11)


def test_integrity_check_catches_a_row_that_is_not_its_locked_prefix():
    cache = simulated_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    req = Req("r", [1, 2, 3, 4, 5])
    admit(cache, req)
    cache.check_integrity([req])
    first = int(cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, 0])
    cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, 0] = first + 1
    with pytest.raises(AssertionError, match="row != prefix"):
        cache.check_integrity([req])
    cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, 0] = first
    cache.unlock(req)
    with pytest.raises(AssertionError, match="prefix unlocked"):
        cache.check_integrity([req])


def hybrid_cache(disable_radix_cache: bool = False) -> CacheManager:
    """Two pools of 256 full and 128 SWA slots, a window of 8."""
    return simulated_cache(
        256,
        max_context_len=256,
        disable_radix_cache=disable_radix_cache,
        swa_slots=128,
        sliding_window=8,
    )


def decode(cache: CacheManager, req: Req, steps: int) -> None:
    """`steps` decode steps: a slot each, committed, then what the scheduler frees."""
    for _ in range(steps):
        slot = cache.alloc_slots(1)
        cache.keep_verified(req, slot)
        cache.free_out_of_window([req])
        cache.check_integrity([req])


def swa_live(cache: CacheManager, req: Req) -> list[bool]:
    assert cache.swa_allocator is not None
    slots = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.kv.allocated_len]
    return cache.swa_allocator.full_to_swa_index_mapping[slots.long()].gt(0).tolist()


def test_decode_frees_its_own_swa_slots_behind_the_window_in_batches():
    cache = hybrid_cache()
    req = Req("a", list(range(100, 110)))
    admit(cache, req)
    cache.commit(req, 10)
    cache.cache_unfinished_req(req)  # the prompt becomes the tree's
    assert cache.swa_allocator is not None
    # After s steps the next query sees positions 10 + s - 7 on: s - 7 are due.
    decode(cache, req, 7 + INTERVAL - 1)
    assert all(swa_live(cache, req)[10:]), "fewer than an interval are due: nothing freed yet"
    decode(cache, req, 1)
    live = swa_live(cache, req)
    seq_len = req.kv.committed_len
    # The next query, at seq_len, sees from seq_len - 7 on: those keep their SWA slots.
    assert live[10 : seq_len - 7] == [False] * (seq_len - 17)
    assert live[:10] == [False] * 3 + [True] * 7, "the tree's window of the prompt, locked"
    assert all(live[seq_len - 7 :])
    assert cache.swa_allocator.full_available_size() == 256 - seq_len


def test_a_request_that_freed_swa_slots_caches_all_of_it_with_the_window_before_its_end():
    cache = hybrid_cache()
    req = Req("a", list(range(100, 110)))
    admit(cache, req)
    cache.commit(req, 10)
    cache.cache_unfinished_req(req)
    decode(cache, req, 8 + INTERVAL)
    req.output_ids = list(range(8 + INTERVAL + 1))
    freed_to = req.kv.swa_evicted_len
    assert freed_to > 10
    cache.cache_unfinished_req(req)  # its own tokens enter the tree, the freed ones as tombstones
    cache.check_integrity([req])
    assert len(req.kv.prefix_indices) == req.kv.committed_len == 18 + INTERVAL
    live = swa_live(cache, req)
    assert live == [False] * (len(live) - 7) + [True] * 7, "the prompt's window went too"
    tree = cache.tree_cache
    assert tree.swa_protected_size() == 7, "a lock protects the SWA KV of its last window - 1"
    assert tree.swa_evictable_size() == 0
    cache.cache_finished_req(req)
    cache.check_integrity()
    assert total_size(tree) == 18 + INTERVAL
    assert (tree.swa_protected_size(), tree.swa_evictable_size()) == (0, 7)
    assert cache.swa_allocator is not None
    assert cache.swa_allocator.swa_available_size() == 128 - 7


def test_without_the_radix_cache_the_whole_row_is_freed_behind_the_window():
    cache = hybrid_cache(disable_radix_cache=True)
    req = Req("a", list(range(100, 160)))
    admit(cache, req)
    cache.commit(req, 60)
    cache.free_out_of_window([req])
    cache.check_integrity([req])
    assert swa_live(cache, req) == [False] * 53 + [True] * 7


def test_integrity_counts_every_swa_slot_once():
    cache = hybrid_cache()
    req = Req("a", list(range(100, 110)))
    admit(cache, req)
    cache.commit(req, 10)
    cache.check_integrity([req])
    assert cache.swa_allocator is not None
    slots = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :2].long()
    swa = cache.swa_allocator.full_to_swa_index_mapping[slots]
    cache.swa_allocator.swa.free(swa[:1])  # an SWA slot both free and held
    with pytest.raises(AssertionError, match="SWA slots held twice"):
        cache.check_integrity([req])
    cache.swa_allocator.full_to_swa_index_mapping[slots[1]] = 0  # a live token lost its slot
    with pytest.raises(AssertionError, match="SWA slots unaccounted"):
        cache.check_integrity([req])


def test_make_room_evicts_the_swa_pool_alone_when_only_it_is_short():
    cache = hybrid_cache()
    for first in range(0, 119, 7):  # 17 prompts of a window - 1: all their SWA is live
        insert_fresh(cache, list(range(1000 + first, 1007 + first)))
    assert cache.swa_allocator is not None
    assert cache.swa_allocator.swa_available_size() == 9
    assert cache.make_room(20)
    assert total_size(cache.tree_cache) == 119, "full KV stays: only SWA KV was short"
    assert cache.swa_allocator.swa_available_size() >= 20
    cache.check_integrity()


def test_a_chunked_prefill_holds_only_its_window_of_the_trees_swa():
    cache = hybrid_cache()
    req = Req("a", list(range(100, 200)))
    admit(cache, req)
    cache.commit(req, 40)  # a first chunk of 40
    cache.cache_unfinished_req(req)
    tree = cache.tree_cache
    assert (tree.swa_protected_size(), tree.swa_evictable_size()) == (7, 0), "33 dropped"
    assert cache.swa_allocator is not None
    assert cache.swa_allocator.swa_available_size() == 128 - 100 + 33, "33 freed at once"
    cache.commit(req, 40)  # the next chunk reads the 7 it kept
    cache.cache_unfinished_req(req)
    cache.check_integrity([req])
    assert len(req.kv.prefix_indices) == 80
    assert swa_live(cache, req)[:80] == [False] * 73 + [True] * 7
