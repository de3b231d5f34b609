import time

import pytest
import torch

from engine.cache.evict_policy import EVICTION_POLICIES
from engine.cache.namespace import PrefixNamespace
from engine.cache.radix_cache import RadixCache
from engine.cache.radix_key import RadixKey
from engine.mem.allocator import TokenToKVPoolAllocator
from testing.radix import insert_fresh, simulated_cache, total_size


def test_match_diverging_mid_edge_does_not_continue_into_the_children():
    """Regression for SGLang's fix 8 days after release: "Hello_world" against a tree of
    "Hello_L.A.!" -> "world" must hit only "Hello_", never the unrelated "world" below."""
    cache = simulated_cache()
    first = insert_fresh(cache, [ord(c) for c in "Hello_L.A.!"])
    insert_fresh(cache, [ord(c) for c in "Hello_L.A.!world"])

    indices, last_node, _ = cache.tree_cache.match_prefix(RadixKey([ord(c) for c in "Hello_world"]))

    assert indices.tolist() == first[:6].tolist()
    assert last_node.key.tolist() == [ord(c) for c in "Hello_"]
    assert [c.key.tolist() for c in last_node.children.values()] == [[ord(c) for c in "L.A.!"]]
    cache.check_integrity()


def test_match_ending_inside_an_edge_splits_it_and_keeps_the_sizes():
    cache = simulated_cache()
    tree = cache.tree_cache
    slots = insert_fresh(cache, [1, 2, 3, 4, 5])
    indices, last_node, _ = tree.match_prefix(RadixKey([1, 2, 3, 9]))
    assert indices.tolist() == slots[:3].tolist()
    assert last_node.key.tolist() == [1, 2, 3]
    assert tree.evictable_size() == total_size(tree) == 5
    cache.check_integrity()


def test_insert_returns_the_length_already_cached_and_keeps_the_whole_key():
    cache = simulated_cache()
    tree, allocator = cache.tree_cache, cache.allocator
    insert_fresh(cache, [1, 2, 3])
    slots = allocator.alloc(5)
    assert tree.insert(RadixKey([1, 2, 3, 4, 5]), slots) == (3, 5)
    allocator.free(slots[:3])
    slots = allocator.alloc(2)
    assert tree.insert(RadixKey([1, 2]), slots) == (2, 2)
    allocator.free(slots)
    assert total_size(tree) == 5
    cache.check_integrity()


def test_locking_moves_a_path_between_evictable_and_protected():
    cache = simulated_cache()
    tree = cache.tree_cache
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 7])
    _, node, _ = tree.match_prefix(RadixKey([1, 2, 3, 4]))

    assert tree.inc_lock_ref(node) == -4
    assert (tree.evictable_size(), tree.protected_size()) == (1, 4)
    assert tree.inc_lock_ref(node) == 0
    assert tree.evict(10) == 1  # only the unlocked [7] can go
    assert tree.match_prefix(RadixKey([1, 2, 3, 4])).device_indices.numel() == 4
    assert tree.dec_lock_ref(node) == 0
    assert tree.dec_lock_ref(node) == 4
    with pytest.raises(RuntimeError, match="unlocked"):
        tree.dec_lock_ref(node)
    cache.check_integrity()


def path_to(node):
    """The nodes root→node, root excluded."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path[::-1]


def test_a_locked_match_splits_the_edge_and_protects_only_its_path():
    cache = simulated_cache()
    tree = cache.tree_cache
    for tokens in ([1, 2, 3], [1, 2, 4, 5], [1, 2, 4, 5, 6, 7], [8, 9, 10, 11, 12]):
        insert_fresh(cache, tokens)
    match = tree.match_prefix(RadixKey([1, 2, 4, 5, 6, 99]))
    tree.inc_lock_ref(match.last_node)

    assert match.last_node.key.tolist() == [6]  # the edge [6, 7] was split
    assert [(n.key.tolist(), n.lock_ref) for n in path_to(match.last_node)] == [
        ([1, 2], 1),
        ([4, 5], 1),
        ([6], 1),
    ]
    assert [c.key.tolist() for c in match.last_node.children.values()] == [[7]]
    assert next(iter(match.last_node.children.values())).lock_ref == 0
    assert (tree.evictable_size(), tree.protected_size()) == (7, 5)
    cache.check_integrity()


def test_evict_cascades_to_parents_that_become_unlocked_leaves():
    cache = simulated_cache()
    tree = cache.tree_cache
    insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [1, 2, 3, 4, 5])
    assert tree.evict(5) == 5
    assert total_size(tree) == 0
    assert cache.allocator.available_size() == 64
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
    cache = simulated_cache(eviction_policy=policy)
    tree = cache.tree_cache
    for token, priority in [(10, 1), (20, 3), (30, 0), (40, 2)]:
        tree.insert(RadixKey([token]), cache.allocator.alloc(1), priority=priority)
        tick()
    for token, hits in [(10, 2), (30, 1), (40, 5)]:
        for _ in range(hits):
            insert_fresh(cache, [token])
            tick()
    for token in [40, 20, 10, 30]:
        tree.match_prefix(RadixKey([token]))
        tick()

    order = []
    while total_size(tree):
        remaining = {child.key[0] for child in tree.root_node.children.values()}
        assert tree.evict(1) == 1
        (gone,) = remaining - {child.key[0] for child in tree.root_node.children.values()}
        order.append(gone)
        cache.check_integrity()
    assert order == EXPECTED_ORDER[policy]


def test_unknown_eviction_policy_is_rejected():
    with pytest.raises(ValueError, match="unknown eviction policy 'clock'"):
        RadixCache(TokenToKVPoolAllocator(1), eviction_policy="clock")


def test_insert_and_match_count_hits_and_raise_priority():
    cache = simulated_cache(eviction_policy="priority")
    tree = cache.tree_cache
    insert_fresh(cache, [1, 2, 3])
    slots = cache.allocator.alloc(3)
    assert tree.insert(RadixKey([1, 2, 3]), slots, priority=5).prefix_len == 3
    cache.allocator.free(slots)
    node = tree.root_node.children[(None, 1)]
    assert (node.hit_count, node.priority) == (1, 5)


def test_namespaces_share_nothing():
    cache = simulated_cache()
    tree = cache.tree_cache
    insert_fresh(cache, [1, 2, 3], PrefixNamespace("tenant-a"))

    assert tree.match_prefix(RadixKey([1, 2, 3])).device_indices.numel() == 0
    assert (
        tree.match_prefix(RadixKey([1, 2, 3], PrefixNamespace("tenant-b"))).device_indices.numel()
        == 0
    )
    assert (
        tree.match_prefix(RadixKey([1, 2, 3], PrefixNamespace("tenant-a"))).device_indices.numel()
        == 3
    )

    slots = cache.allocator.alloc(3)
    assert tree.insert(RadixKey([1, 2, 3], PrefixNamespace("tenant-b")), slots).prefix_len == 0
    assert total_size(tree) == 6
    assert len(tree.root_node.children) == 2
    cache.check_integrity()


def test_integrity_check_catches_a_leaked_slot_and_a_double_free():
    cache = simulated_cache()
    insert_fresh(cache, [1, 2, 3])
    leaked = cache.allocator.alloc(1)
    with pytest.raises(AssertionError, match="unaccounted"):
        cache.check_integrity()
    cache.allocator.free(leaked)
    cache.allocator.free(leaked)
    with pytest.raises(AssertionError, match="twice"):
        cache.check_integrity()


def test_tree_integrity_check_catches_a_wrong_ledger():
    cache = simulated_cache()
    tree = cache.tree_cache
    insert_fresh(cache, [1, 2, 3])
    tree.evictable_size_ += 1
    with pytest.raises(AssertionError, match="evictable_size_"):
        tree.check_integrity()


def test_cached_slots_are_every_slot_the_tree_holds():
    cache = simulated_cache()
    a = insert_fresh(cache, [1, 2, 3])
    b = insert_fresh(cache, [1, 2, 4, 5])
    expected = sorted(a.tolist() + b[2:].tolist())
    assert sorted(cache.tree_cache.cached_slots().tolist()) == expected
    assert torch.equal(
        simulated_cache().tree_cache.cached_slots(), torch.empty(0, dtype=torch.int64)
    )
