"""The radix tree of a hybrid model: full KV per node, SWA KV only where still live.

A window of 4: a query reads the SWA KV of the 3 tokens before it, so a match must end
after 3 live tokens (or be live from the root), and a lock protects the SWA KV of 3."""

from __future__ import annotations

import pytest
import torch

from engine.cache.radix_key import RadixKey
from engine.cache.swa_radix_cache import SWARadixCache
from engine.mem.swa_allocator import SWATokenToKVPoolAllocator
from engine.sched.cache_manager import CacheManager
from testing.radix import simulated_cache, total_size

WINDOW = 4
SEQ = list(range(10, 20))


def hybrid() -> tuple[CacheManager, SWARadixCache, SWATokenToKVPoolAllocator]:
    cache = simulated_cache(num_slots=64, swa_slots=48, sliding_window=WINDOW)
    tree, allocator = cache.tree_cache, cache.allocator
    assert isinstance(tree, SWARadixCache) and isinstance(allocator, SWATokenToKVPoolAllocator)
    return cache, tree, allocator


def insert(
    tree: SWARadixCache, allocator: SWATokenToKVPoolAllocator, seq: list[int], live_from: int = 0
) -> torch.Tensor:
    """Insert `seq` over fresh slots whose SWA KV before `live_from` was freed, as a request
    behind its window hands them over; frees the duplicates."""
    slots = allocator.alloc(len(seq))
    assert slots is not None
    allocator.free_swa(slots[:live_from])
    inserted = tree.insert(RadixKey(seq), slots, swa_live_from=live_from)
    allocator.free(slots[: inserted.prefix_len])
    return slots


def matched_len(tree: SWARadixCache, seq: list[int]) -> int:
    indices, node, _ = tree.match_prefix(RadixKey(seq))
    assert torch.equal(node.matched_indices(), indices), "the handle's path is the match"
    return len(indices)


def live(tree: SWARadixCache) -> int:
    return len(tree.cached_swa_slots())


def test_insert_keeps_live_swa_only_in_the_window_before_the_key_end():
    cache, tree, allocator = hybrid()
    insert(tree, allocator, SEQ, live_from=6)
    cache.check_integrity()
    (node,) = tree.root_node.children.values()
    assert len(node.key) == 6 and node.swa_tombstone
    (middle,) = node.children.values()
    assert len(middle.key) == 1 and middle.swa_tombstone, "behind the window: dropped"
    (tail,) = middle.children.values()
    assert len(tail.key) == WINDOW - 1 and not tail.swa_tombstone
    assert (tree.evictable_size(), tree.swa_evictable_size()) == (10, WINDOW - 1)
    assert allocator.swa_available_size() == 48 - (WINDOW - 1)


def test_match_ends_where_the_window_before_it_is_live():
    cache, tree, allocator = hybrid()
    insert(tree, allocator, SEQ)
    assert matched_len(tree, SEQ + [99]) == 10  # 3 live before the end
    assert matched_len(tree, SEQ[:9]) == 0, "2 live before 9, then tombstones"
    cache.check_integrity()


def test_a_branch_point_keeps_its_window_for_the_requests_after_the_branching_one():
    """The fan-out: the first request's prompt ran alone, so its shared part kept no window.
    The second recomputes it; its insert makes the branch point, whose window stays live,
    so the third hits up to it. Without checkpoints the third recomputes too."""
    for checkpoints, third_hit in ((True, 6), (False, 0)):
        cache = simulated_cache(
            num_slots=64, swa_slots=48, sliding_window=WINDOW, window_checkpoints=checkpoints
        )
        tree, allocator = cache.tree_cache, cache.allocator
        assert isinstance(tree, SWARadixCache)
        assert isinstance(allocator, SWATokenToKVPoolAllocator)
        insert(tree, allocator, SEQ)
        assert matched_len(tree, SEQ[:6] + [98]) == 0, "the first left no window at 6"
        insert(tree, allocator, SEQ[:6] + [98, 97])
        assert matched_len(tree, SEQ[:6] + [96]) == third_hit
        cache.check_integrity()
        assert live(tree) == (WINDOW - 1) * 2 + (2 if checkpoints else 0)


def test_a_match_the_window_cuts_back_reports_its_full_kv_length():
    cache, tree, allocator = hybrid()
    insert(tree, allocator, SEQ, live_from=6)
    cut = tree.match_prefix(RadixKey(SEQ[:8] + [99]))
    assert (len(cut.device_indices), cut.full_match_len) == (0, 8)
    whole = tree.match_prefix(RadixKey(SEQ + [99]))
    assert (len(whole.device_indices), whole.full_match_len) == (10, 10)
    cache.check_integrity()


def test_match_ending_inside_a_tombstone_falls_back_to_the_last_live_window():
    cache, tree, allocator = hybrid()
    insert(tree, allocator, SEQ[:5])  # live [2, 5)
    _, held, _ = tree.match_prefix(RadixKey(SEQ[:5]))
    tree.inc_lock_ref(held)  # a running request reads the window before 5
    insert(tree, allocator, SEQ, live_from=8)  # [5, 8) tombstones, [8, 10) live
    assert matched_len(tree, SEQ[:7] + [99]) == 5, "ends inside [5, 8): back to 5"
    assert matched_len(tree, SEQ) == 5, "only 2 live before 10"
    tree.dec_lock_ref(held)
    cache.check_integrity()


def test_a_match_shorter_than_the_window_must_be_live_from_the_root():
    cache, tree, allocator = hybrid()
    insert(tree, allocator, [1, 2])
    insert(tree, allocator, [5, 6], live_from=1)
    assert matched_len(tree, [1, 2, 3]) == 2
    assert matched_len(tree, [5, 6, 7]) == 0
    cache.check_integrity()


def test_swa_eviction_tombstones_least_recently_used_before_any_full_eviction():
    cache, tree, allocator = hybrid()
    insert(tree, allocator, [1, 2, 3, 4, 5])
    insert(tree, allocator, SEQ)
    matched_len(tree, [1, 2, 3, 4, 5])  # used since: SEQ is now least recently used
    assert tree.evict_swa(1) == WINDOW - 1
    assert live(tree) == WINDOW - 1 and total_size(tree) == 15, "full KV stays"
    assert (tree.evictable_size(), tree.swa_evictable_size()) == (15, WINDOW - 1)
    assert allocator.swa_available_size() == 48 - (WINDOW - 1)
    assert matched_len(tree, SEQ) == 0 and matched_len(tree, [1, 2, 3, 4, 5]) == 5
    cache.check_integrity()
    assert tree.evict(15) == 15
    assert allocator.swa_available_size() == 48 and allocator.full_available_size() == 64
    cache.check_integrity()


def test_live_swa_over_a_tombstone_revives_it_and_the_duplicates_free_only_full_slots():
    cache, tree, allocator = hybrid()
    first = insert(tree, allocator, SEQ, live_from=6)  # live [7, 10)
    second = insert(tree, allocator, SEQ[:8] + [99, 98])  # every SWA slot live
    cache.check_integrity()
    assert matched_len(tree, SEQ[:8] + [97]) == 8, "the branch point's window [5, 8)"
    mapping = allocator.full_to_swa_index_mapping
    assert mapping[first[5:]].all(), "[5, 7) took the second request's SWA slots"
    assert not mapping[first[:5]].any() and not mapping[second[:8]].any()
    assert mapping[second[8:]].all()
    assert allocator.swa_available_size() == 48 - 7, "one SWA copy of each live token"
    assert allocator.full_available_size() == 64 - 12


def test_a_lock_keeps_the_swa_of_its_window_through_others_inserts():
    cache, tree, allocator = hybrid()
    insert(tree, allocator, SEQ)
    _, node, _ = tree.match_prefix(RadixKey(SEQ))
    tree.inc_lock_ref(node)
    assert (tree.protected_size(), tree.swa_protected_size()) == (10, WINDOW - 1)
    insert(tree, allocator, SEQ + [1, 2, 3, 4, 5])  # would drop SEQ's window, but it is read
    assert matched_len(tree, SEQ + [99]) == 10, "its last window is still live"
    assert tree.evict(100) == 5, "the extension goes; full KV of a locked path stays"
    insert(tree, allocator, SEQ[:8] + [99], live_from=8)  # a split inside the locked window
    cache.check_integrity()
    tree.dec_lock_ref(node)
    assert (tree.protected_size(), tree.swa_protected_size()) == (0, 0)
    cache.check_integrity()
    assert tree.evict_swa(100) == WINDOW - 1 + 1  # the window and the new leaf
    cache.check_integrity()


def test_integrity_catches_a_tombstone_holding_swa_and_a_wrong_swa_ledger():
    cache, tree, allocator = hybrid()
    slots = insert(tree, allocator, SEQ, live_from=6)
    swa = allocator.swa.alloc(1)
    assert swa is not None
    allocator.full_to_swa_index_mapping[slots[0]] = swa[0]
    with pytest.raises(AssertionError, match="tombstone has SWA"):
        tree.check_integrity()
    allocator.full_to_swa_index_mapping[slots[0]] = 0
    allocator.swa.free(swa)
    tree.swa_evictable_size_ += 1
    with pytest.raises(AssertionError, match="SWA ledgers"):
        tree.check_integrity()
