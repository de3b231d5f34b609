"""Differential test of the hybrid model's tree: random interleavings of insert (with SWA
KV freed before a random boundary) / match / lock / unlock / evict / evict_swa against a
brute-force model that stores each cached token's slot and whether its SWA KV is live,
with window checkpoints on and off. After an insert, the model keeps live SWA on the key's
path only within the windows before its end and (checkpoints on) its branch points, or
under an SWA lock.

A window of 3: a match must end after 2 live tokens (or be live from the root), and a
lock protects the SWA KV of its last 2. Short sequences on a three-token alphabet make
edges split constantly.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.cache.radix_key import RadixKey
from engine.cache.swa_radix_cache import SWARadixCache
from engine.cache.tree_node import TreeNode
from engine.mem.swa_allocator import SWATokenToKVPoolAllocator
from testing.radix import simulated_cache

NUM_SLOTS, NUM_SWA_SLOTS, WINDOW = 40, 24, 3
TAIL = WINDOW - 1
Position = tuple[int, ...]  # the token prefix ending at one cached token

sequences = st.lists(st.integers(0, 2), min_size=1, max_size=8)


class SWARadixCacheVersusBruteForce(RuleBasedStateMachine):
    window_checkpoints = True

    def __init__(self) -> None:
        super().__init__()
        self.slot_of: dict[Position, int] = {}
        self.live: set[Position] = set()
        self.lock_count: Counter[Position] = Counter()
        self.swa_lock_count: Counter[Position] = Counter()
        self.locks: list[tuple[TreeNode, list[Position]]] = []

    @initialize()
    def make_cache(self) -> None:
        self.manager = simulated_cache(
            num_slots=NUM_SLOTS,
            swa_slots=NUM_SWA_SLOTS,
            sliding_window=WINDOW,
            window_checkpoints=self.window_checkpoints,
        )
        tree, allocator = self.manager.tree_cache, self.manager.allocator
        assert isinstance(tree, SWARadixCache)
        assert isinstance(allocator, SWATokenToKVPoolAllocator)
        self.cache, self.allocator = tree, allocator

    def cached_len(self, seq: list[int]) -> int:
        n = 0
        while n < len(seq) and tuple(seq[: n + 1]) in self.slot_of:
            n += 1
        return n

    def usable_len(self, seq: list[int]) -> int:
        """The longest cached prefix whose last `TAIL` tokens (or all) are live."""
        path = [tuple(seq[: i + 1]) for i in range(self.cached_len(seq))]
        return max(
            p
            for p in range(len(path) + 1)
            if all(q in self.live for q in path[max(0, p - TAIL) : p])
        )

    @rule(seq=sequences, data=st.data())
    def insert(self, seq: list[int], data: st.DataObject) -> None:
        live_from = data.draw(st.integers(0, len(seq)))
        if not self.manager.make_room(len(seq)):
            return
        self.sync_evicted()
        slots = self.allocator.alloc(len(seq))
        assert slots is not None
        self.allocator.free_swa(slots[:live_from])
        expected = self.cached_len(seq)
        inserted = self.cache.insert(RadixKey(seq), slots, swa_live_from=live_from)
        assert inserted == (expected, len(seq))
        self.allocator.free(slots[:expected])
        for i in range(len(seq)):
            position = tuple(seq[: i + 1])
            if i >= expected:
                self.slot_of[position] = int(slots[i])
            if i >= live_from:
                self.live.add(position)
        self.drop_unmatchable(seq)

    def drop_unmatchable(self, seq: list[int]) -> None:
        ends = [len(seq)]
        if self.window_checkpoints:
            ends += [e for e in range(1, len(seq)) if self.branches(tuple(seq[:e]))]
        for i in range(len(seq)):
            position = tuple(seq[: i + 1])
            in_window = any(e - TAIL <= i < e for e in ends)
            if not in_window and not self.swa_lock_count[position]:
                self.live.discard(position)

    def branches(self, prefix: Position) -> bool:
        return (
            len(
                {
                    p[len(prefix)]
                    for p in self.slot_of
                    if p[: len(prefix)] == prefix and len(p) > len(prefix)
                }
            )
            > 1
        )

    @rule(seq=sequences, lock=st.booleans())
    def match(self, seq: list[int], lock: bool) -> None:
        indices, last_node, _ = self.cache.match_prefix(RadixKey(seq))
        n = self.usable_len(seq)
        path = [tuple(seq[: i + 1]) for i in range(n)]
        assert indices.tolist() == [self.slot_of[p] for p in path]
        assert last_node.matched_indices().tolist() == indices.tolist()
        if lock:
            newly_locked = sum(self.lock_count[p] == 0 for p in path)
            assert self.cache.inc_lock_ref(last_node) == -newly_locked
            self.lock_count.update(path)
            self.swa_lock_count.update(path[max(0, n - TAIL) :])
            self.locks.append((last_node, path))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, path = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.lock_count.subtract(path)
        self.swa_lock_count.subtract(path[max(0, len(path) - TAIL) :])
        assert self.cache.dec_lock_ref(node) == sum(self.lock_count[p] == 0 for p in path)

    @rule(num_tokens=st.integers(1, NUM_SLOTS))
    def evict(self, num_tokens: int) -> None:
        evictable_before = self.cache.evictable_size()
        evicted = self.cache.evict(num_tokens)
        assert evicted >= min(num_tokens, evictable_before)
        assert self.sync_evicted() == (evicted, 0)

    @rule(num_tokens=st.integers(1, NUM_SWA_SLOTS))
    def evict_swa(self, num_tokens: int) -> None:
        evictable_before = self.cache.swa_evictable_size()
        evicted = self.cache.evict_swa(num_tokens)
        assert evicted >= min(num_tokens, evictable_before)
        assert self.sync_evicted() == (0, evicted)

    def sync_evicted(self) -> tuple[int, int]:
        """Drop from the model what the cache freed; (full, SWA-only) tokens freed."""
        free = set(self.allocator.free_slots().tolist())
        mapping = self.allocator.full_to_swa_index_mapping
        gone = {p for p, slot in self.slot_of.items() if slot in free}
        tombstoned = {p for p in self.live - gone if not mapping[self.slot_of[p]]}
        assert not any(self.lock_count[p] for p in gone), "a locked node was evicted"
        assert not any(self.swa_lock_count[p] for p in tombstoned), "locked SWA was evicted"
        for p in gone:
            del self.slot_of[p]
        self.live -= gone | tombstoned
        for prefix in self.slot_of:
            assert len(prefix) == 1 or prefix[:-1] in self.slot_of, "a gap below a token"
        return len(gone), len(tombstoned)

    @invariant()
    def tree_agrees_with_the_model(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.manager.check_integrity()  # both pools' slots each accounted once
        protected = sum(1 for p in self.slot_of if self.lock_count[p] > 0)
        assert (self.cache.protected_size(), self.cache.evictable_size()) == (
            protected,
            len(self.slot_of) - protected,
        )
        swa_protected = sum(1 for p in self.live if self.swa_lock_count[p] > 0)
        assert (self.cache.swa_protected_size(), self.cache.swa_evictable_size()) == (
            swa_protected,
            len(self.live) - swa_protected,
        )
        assert sorted(self.cache.cached_swa_slots().tolist()) == sorted(
            self.slot_of[p] for p in self.live
        )


SWARadixCacheVersusBruteForce.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
test_swa_radix_cache_matches_brute_force_model = SWARadixCacheVersusBruteForce.TestCase


class WithoutCheckpoints(SWARadixCacheVersusBruteForce):
    window_checkpoints = False


WithoutCheckpoints.TestCase.settings = SWARadixCacheVersusBruteForce.TestCase.settings
test_swa_radix_cache_without_checkpoints_matches_brute_force_model = WithoutCheckpoints.TestCase
