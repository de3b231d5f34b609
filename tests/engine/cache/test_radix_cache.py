import subprocess
import sys
import time

import pytest
import torch

from engine.cache.evict_policy import EVICTION_POLICIES
from engine.cache.radix_cache import RadixCache
from engine.cache.radix_key import RadixKey
from engine.sched.req import Req


def insert_fresh(
    cache: RadixCache, tokens: list[int], extra_key: str | None = None
) -> torch.Tensor:
    """Insert `tokens` with newly allocated slots, freeing the duplicates as callers must."""
    allocator = cache.token_to_kv_pool_allocator
    slots = allocator.alloc(len(tokens))
    present = cache.insert(RadixKey(tokens, extra_key), slots)
    allocator.free(slots[:present])
    return slots


def admit(cache: RadixCache, req: Req, extra_slots: int = 0) -> None:
    """What the scheduler does on admission: match, lock, take a row, allocate the rest."""
    prefix, last_node = cache.match_prefix(RadixKey(req.origin_input_ids, req.extra_key))
    cache.inc_lock_ref(last_node)
    (row,) = cache.req_to_token_pool.alloc(1)
    new = cache.token_to_kv_pool_allocator.alloc(
        len(req.origin_input_ids) - len(prefix) + extra_slots
    )
    cache.req_to_token_pool.write(row, 0, torch.cat([prefix, new]))
    req.req_pool_idx, req.prefix_indices, req.last_node = row, prefix, last_node
    req.kv_allocated_len = len(prefix) + len(new)


def row_slots(cache: RadixCache, req: Req, n: int) -> list[int]:
    return cache.req_to_token_pool.req_to_token[req.req_pool_idx, :n].tolist()


def test_match_diverging_mid_edge_does_not_continue_into_the_children():
    """Regression for SGLang's fix 8 days after release: "Hello_world" against a tree of
    "Hello_L.A.!" -> "world" must hit only "Hello_", never the unrelated "world" below."""
    cache = RadixCache.create_simulated()
    first = insert_fresh(cache, [ord(c) for c in "Hello_L.A.!"])
    insert_fresh(cache, [ord(c) for c in "Hello_L.A.!world"])

    indices, last_node = cache.match_prefix(RadixKey([ord(c) for c in "Hello_world"]))

    assert indices.tolist() == first[:6].tolist()
    assert last_node.key.tolist() == [ord(c) for c in "Hello_"]
    assert [c.key.tolist() for c in last_node.children.values()] == [[ord(c) for c in "L.A.!"]]
    cache.check_integrity()


def test_match_ending_inside_an_edge_splits_it_and_keeps_the_sizes():
    cache = RadixCache.create_simulated()
    slots = insert_fresh(cache, [1, 2, 3, 4, 5])
    indices, last_node = cache.match_prefix(RadixKey([1, 2, 3, 9]))
    assert indices.tolist() == slots[:3].tolist()
    assert last_node.key.tolist() == [1, 2, 3]
    assert cache.evictable_size() == cache.total_size() == 5
    cache.check_integrity()


def test_insert_returns_the_length_already_cached():
    cache = RadixCache.create_simulated()
    insert_fresh(cache, [1, 2, 3])
    allocator = cache.token_to_kv_pool_allocator
    slots = allocator.alloc(5)
    assert cache.insert(RadixKey([1, 2, 3, 4, 5]), slots) == 3
    allocator.free(slots[:3])
    slots = allocator.alloc(2)
    assert cache.insert(RadixKey([1, 2]), slots) == 2
    allocator.free(slots)
    assert cache.total_size() == 5
    cache.check_integrity()


def test_locking_moves_a_path_between_evictable_and_protected():
    cache = RadixCache.create_simulated()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 7])
    _, node = cache.match_prefix(RadixKey([1, 2, 3, 4]))

    assert cache.inc_lock_ref(node) == -4
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    assert cache.inc_lock_ref(node) == 0
    assert cache.evict(10) == 1  # only the unlocked [7] can go
    assert cache.match_prefix(RadixKey([1, 2, 3, 4])).device_indices.numel() == 4
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 4
    with pytest.raises(RuntimeError, match="unlocked"):
        cache.dec_lock_ref(node)
    cache.check_integrity()


def test_evict_cascades_to_parents_that_become_unlocked_leaves():
    cache = RadixCache.create_simulated()
    insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [1, 2, 3, 4, 5])
    assert cache.evict(5) == 5
    assert cache.total_size() == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 64
    cache.check_integrity()


# Four leaves built through the public API so every policy key differs:
#   token  inserted  priority  hits (re-inserts)  last matched
#   10     1st       1         2                  3rd
#   20     2nd       3         0                  2nd
#   30     3rd       0         1                  4th (most recent)
#   40     4th       2         5                  1st (least recent)
EXPECTED_ORDER = {
    "lru": [40, 20, 10, 30],
    "mru": [30, 10, 20, 40],
    "fifo": [10, 20, 30, 40],
    "filo": [40, 30, 20, 10],
    "lfu": [20, 30, 10, 40],
    "slru": [20, 30, 40, 10],  # 20 and 30 (< 2 hits) are probationary, by recency; then 40, 10
    "priority": [30, 10, 40, 20],
}


def tick() -> None:
    """Keep monotonic timestamps strictly apart on coarse clocks."""
    time.sleep(0.002)


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_each_eviction_policy_evicts_in_its_order(policy):
    cache = RadixCache.create_simulated(eviction_policy=policy)
    allocator = cache.token_to_kv_pool_allocator
    for token, priority in [(10, 1), (20, 3), (30, 0), (40, 2)]:
        cache.insert(RadixKey([token]), allocator.alloc(1), priority=priority)
        tick()
    for token, hits in [(10, 2), (30, 1), (40, 5)]:
        for _ in range(hits):
            insert_fresh(cache, [token])
            tick()
    for token in [40, 20, 10, 30]:
        cache.match_prefix(RadixKey([token]))
        tick()

    order = []
    while cache.total_size():
        remaining = {child.key[0] for child in cache.root_node.children.values()}
        assert cache.evict(1) == 1
        (gone,) = remaining - {child.key[0] for child in cache.root_node.children.values()}
        order.append(gone)
        cache.check_integrity()
    assert order == EXPECTED_ORDER[policy]


def test_unknown_eviction_policy_is_rejected():
    with pytest.raises(ValueError, match="unknown eviction policy 'clock'"):
        RadixCache.create_simulated(eviction_policy="clock")


def test_insert_and_match_count_hits_and_raise_priority():
    cache = RadixCache.create_simulated(eviction_policy="priority")
    insert_fresh(cache, [1, 2, 3])
    allocator = cache.token_to_kv_pool_allocator
    slots = allocator.alloc(3)
    assert cache.insert(RadixKey([1, 2, 3]), slots, priority=5) == 3
    allocator.free(slots)
    node = cache.root_node.children[(None, 1)]
    assert (node.hit_count, node.priority) == (1, 5)


def test_namespaces_share_nothing():
    cache = RadixCache.create_simulated()
    insert_fresh(cache, [1, 2, 3], "tenant-a")

    assert cache.match_prefix(RadixKey([1, 2, 3])).device_indices.numel() == 0
    assert cache.match_prefix(RadixKey([1, 2, 3], "tenant-b")).device_indices.numel() == 0
    assert cache.match_prefix(RadixKey([1, 2, 3], "tenant-a")).device_indices.numel() == 3

    allocator = cache.token_to_kv_pool_allocator
    slots = allocator.alloc(3)
    assert cache.insert(RadixKey([1, 2, 3], "tenant-b"), slots) == 0
    assert cache.total_size() == 6
    assert len(cache.root_node.children) == 2
    cache.check_integrity()


def test_two_requests_with_one_prompt_end_with_one_copy_of_its_slots():
    cache = RadixCache.create_simulated()
    prompt = list(range(100, 110))
    a, b = Req("a", prompt, output_ids=[7]), Req("b", prompt, output_ids=[8])
    admit(cache, a)
    admit(cache, b)  # admitted together: neither sees the other's KV yet
    for req in (a, b):
        req.kv_committed_len = len(prompt)
    a_slots = row_slots(cache, a, len(prompt))
    cache.check_integrity([a, b])

    cache.cache_finished_req(a)
    cache.check_integrity([b])
    cache.cache_finished_req(b)

    assert cache.total_size() == len(prompt)
    assert cache.match_prefix(RadixKey(prompt)).device_indices.tolist() == a_slots
    assert cache.token_to_kv_pool_allocator.available_size() == 64 - len(prompt)
    cache.check_integrity()


def test_unfinished_req_is_repointed_at_the_shared_copy_and_locks_it():
    cache = RadixCache.create_simulated()
    prompt = list(range(100, 110))
    a, b = Req("a", prompt), Req("b", prompt)
    admit(cache, a)
    admit(cache, b)
    for req in (a, b):
        req.kv_committed_len = len(prompt)
    a_slots = row_slots(cache, a, len(prompt))

    cache.cache_unfinished_req(a)
    cache.cache_unfinished_req(b)

    assert row_slots(cache, b, len(prompt)) == a_slots
    assert b.prefix_indices.tolist() == a_slots and b.last_node is a.last_node
    assert a.last_node.lock_ref == 2
    assert (cache.evictable_size(), cache.protected_size()) == (0, len(prompt))
    cache.check_integrity([a, b])


def test_finished_req_inserts_input_and_all_but_the_last_output_token():
    cache = RadixCache.create_simulated()
    req = Req("r", [1, 2, 3, 4, 5], output_ids=[6, 7, 8])
    admit(cache, req, extra_slots=3)  # slots for 6, 7 and the never-forwarded 8
    req.kv_committed_len = 7
    slots = row_slots(cache, req, 8)

    cache.cache_finished_req(req)

    assert cache.total_size() == 7
    assert (
        cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6, 7, 8])).device_indices.tolist() == slots[:7]
    )
    assert slots[7] in cache.token_to_kv_pool_allocator.free_slots().tolist()
    assert cache.req_to_token_pool.available_size() == cache.req_to_token_pool.size
    cache.check_integrity()


def test_chunked_prefill_self_inserts_do_not_count_hits():
    cache = RadixCache.create_simulated(eviction_policy="lfu")
    prompt = list(range(200, 212))
    req = Req("long", prompt)
    (row,) = cache.req_to_token_pool.alloc(1)
    req.req_pool_idx = row
    for start in range(0, 12, 4):  # three chunks of 4 tokens
        cache.req_to_token_pool.write(row, start, cache.token_to_kv_pool_allocator.alloc(4))
        req.kv_allocated_len = req.kv_committed_len = start + 4
        cache.cache_unfinished_req(req)
        cache.check_integrity([req])
        assert len(req.prefix_indices) == start + 4

    assert all(node.hit_count == 0 for node in cache._nodes())
    other = Req("other", prompt + [1])
    admit(cache, other)
    assert len(other.prefix_indices) == 12
    cache.check_integrity([req, other])


def test_disabled_cache_matches_nothing_and_frees_everything_on_finish():
    cache = RadixCache.create_simulated(disable=True)
    insert_fresh(cache, [1, 2, 3])
    assert cache.total_size() == 0
    assert cache.insert(RadixKey([4, 5]), torch.tensor([1, 2])) == 2
    req = Req("r", [1, 2, 3], output_ids=[4])
    admit(cache, req, extra_slots=1)
    assert req.prefix_indices.numel() == 0 and req.last_node is cache.root_node
    req.kv_committed_len = 3
    cache.cache_unfinished_req(req)
    cache.check_integrity([req])

    cache.cache_finished_req(req)

    assert cache.evict(10) == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 64
    cache.check_integrity()


def test_integrity_check_catches_a_leaked_slot_and_a_double_free():
    cache = RadixCache.create_simulated()
    insert_fresh(cache, [1, 2, 3])
    leaked = cache.token_to_kv_pool_allocator.alloc(1)
    with pytest.raises(AssertionError, match="unaccounted"):
        cache.check_integrity()
    cache.token_to_kv_pool_allocator.free(leaked)
    cache.token_to_kv_pool_allocator.free(leaked)
    with pytest.raises(AssertionError, match="twice"):
        cache.check_integrity()


def test_page_sizes_above_one_are_rejected():
    with pytest.raises(ValueError, match="page_size=16"):
        RadixCache.create_simulated(page_size=16)


def test_module_main_prints_a_simulated_tree_with_lock_counts():
    out = subprocess.run(
        [sys.executable, "-m", "engine.cache.radix_cache"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "[1, 2] len=2 lock_ref=1" in out
    assert "[7] len=1 lock_ref=0" in out
    assert "evictable: 7, protected: 5" in out


def test_finishing_without_insert_frees_owned_slots_and_unlocks_the_prefix():
    cache = RadixCache.create_simulated()
    insert_fresh(cache, [1, 2, 3, 4])
    req = Req("retracted", [1, 2, 3, 4, 5, 6], output_ids=[7])
    admit(cache, req, extra_slots=1)
    assert len(req.prefix_indices) == 4 and cache.protected_size() == 4
    req.kv_committed_len = 6

    cache.cache_finished_req(req, is_insert=False)

    assert cache.total_size() == 4 and cache.protected_size() == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 64 - 4
    cache.check_integrity()
