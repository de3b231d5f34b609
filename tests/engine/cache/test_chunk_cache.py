"""The cache that shares nothing answers the whole interface: an empty handle that pins
nothing, arrival order, and KV events that stop at the start-up clear."""

from __future__ import annotations

import pytest

from engine.cache.kv_events import AllBlocksCleared, BlockEventRecorder
from engine.cache.radix_key import RadixKey
from testing.radix import insert_fresh, simulated_cache


def test_a_match_hands_back_an_empty_handle_that_locking_leaves_unpinned():
    cache = simulated_cache(disable_radix_cache=True)
    tree = cache.tree_cache
    match = tree.match_prefix(RadixKey([1, 2, 3]))
    assert (tree.inc_lock_ref(match.last_node), match.last_node.lock_ref) == (0, 0)
    assert match.last_node.matched_indices().numel() == 0 and tree.protected_size() == 0
    assert tree.dec_lock_ref(match.last_node) == 0


def test_the_dfs_weight_order_is_arrival_order():
    tree = simulated_cache(disable_radix_cache=True).tree_cache
    handles = {name: tree.match_prefix(RadixKey([i])).last_node for i, name in enumerate("cab")}
    assert tree.dfs_weight_order(list("cab"), handles.__getitem__) == ["c", "a", "b"]


def test_kv_events_record_the_start_up_clear_and_nothing_after():
    cache = simulated_cache(disable_radix_cache=True)
    recorder = BlockEventRecorder(4)
    cache.tree_cache.attach_kv_events(recorder)
    insert_fresh(cache, list(range(16)))
    cache.reset()
    assert recorder.take() == [AllBlocksCleared()]


def test_a_radix_tree_refuses_another_caches_handle():
    empty = simulated_cache(disable_radix_cache=True).tree_cache.match_prefix(RadixKey([1]))
    tree = simulated_cache().tree_cache
    with pytest.raises(TypeError, match="not a radix tree's handle"):
        tree.inc_lock_ref(empty.last_node)
