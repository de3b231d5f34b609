"""Differential test: random interleavings of insert / match / lock / unlock / evict on
the radix cache against a brute-force model that stores every cached prefix explicitly.

Short sequences on a three-token alphabet make edges split constantly; three namespaces
check that they never share anything.
"""

from __future__ import annotations

from collections import Counter

import msgpack
import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.cache.evict_policy import EVICTION_POLICIES
from engine.cache.kv_events import BlockEventRecorder, block_hashes
from engine.cache.namespace import PrefixNamespace
from engine.cache.radix_key import RadixKey
from engine.cache.tree_node import TreeNode
from testing.kv_events import apply_events
from testing.radix import simulated_cache, total_size

NUM_SLOTS = 40
KV_BLOCK_SIZE = 2
Position = tuple[str | None, tuple[int, ...]]  # (namespace, token prefix): one cached token

namespaces = st.sampled_from([None, PrefixNamespace("a"), PrefixNamespace("b")])
sequences = st.lists(st.integers(0, 2), min_size=1, max_size=8)


class RadixCacheVersusBruteForce(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.slot_of: dict[Position, int] = {}
        self.lock_count: Counter[Position] = Counter()
        self.locks: list[tuple[TreeNode, list[Position]]] = []

    @initialize(policy=st.sampled_from(sorted(EVICTION_POLICIES)))
    def make_cache(self, policy: str) -> None:
        self.manager = simulated_cache(num_slots=NUM_SLOTS, eviction_policy=policy)
        self.cache = self.manager.tree_cache
        self.allocator = self.manager.allocator
        self.events = BlockEventRecorder(KV_BLOCK_SIZE)
        self.cache.attach_kv_events(self.events)
        self.published: set[int] = set()

    def cached_len(self, ns: PrefixNamespace | None, seq: list[int]) -> int:
        """The model is prefix-closed, so the longest cached prefix is the first gap."""
        n = 0
        while n < len(seq) and (ns, tuple(seq[: n + 1])) in self.slot_of:
            n += 1
        return n

    @rule(ns=namespaces, seq=sequences)
    def insert(self, ns: PrefixNamespace | None, seq: list[int]) -> None:
        if self.allocator.available_size() < len(seq):
            self.evict(len(seq) - self.allocator.available_size())
        slots = self.allocator.alloc(len(seq))
        if slots is None:
            return
        expected = self.cached_len(ns, seq)
        assert self.cache.insert(RadixKey(seq, ns), slots) == (expected, len(seq))
        self.allocator.free(slots[:expected])
        for i in range(expected, len(seq)):
            self.slot_of[(ns, tuple(seq[: i + 1]))] = int(slots[i])

    @rule(ns=namespaces, seq=sequences, lock=st.booleans())
    def match(self, ns: PrefixNamespace | None, seq: list[int], lock: bool) -> None:
        indices, last_node, _ = self.cache.match_prefix(RadixKey(seq, ns))
        n = self.cached_len(ns, seq)
        path = [(ns, tuple(seq[: i + 1])) for i in range(n)]
        assert indices.tolist() == [self.slot_of[p] for p in path]
        assert len(last_node.key) > 0 or n == 0
        if lock:
            newly_locked = sum(self.lock_count[p] == 0 for p in path)
            assert self.cache.inc_lock_ref(last_node) == -newly_locked
            self.lock_count.update(path)
            self.locks.append((last_node, path))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, path = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.lock_count.subtract(path)
        freed = sum(self.lock_count[p] == 0 for p in path)
        assert self.cache.dec_lock_ref(node) == freed

    @rule(num_tokens=st.integers(1, NUM_SLOTS))
    def evict(self, num_tokens: int) -> None:
        evictable_before = self.cache.evictable_size()
        evicted = self.cache.evict(num_tokens)
        free = set(self.allocator.free_slots().tolist())
        gone = {p for p, slot in self.slot_of.items() if slot in free}
        assert evicted == len(gone)
        assert evicted >= min(num_tokens, evictable_before)
        assert not any(self.lock_count[p] for p in gone), "a locked node was evicted"
        for p in gone:
            del self.slot_of[p]
        for ns, prefix in self.slot_of:
            assert len(prefix) == 1 or (ns, prefix[:-1]) in self.slot_of, (
                "eviction left a gap below a cached token"
            )

    @invariant()
    def tree_agrees_with_the_model(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.manager.check_integrity()  # the tree's own check, and every slot accounted once
        protected = sum(1 for p in self.slot_of if self.lock_count[p] > 0)
        assert self.cache.protected_size() == protected
        assert self.cache.evictable_size() == len(self.slot_of) - protected
        assert total_size(self.cache) == len(self.slot_of)

    @invariant()
    def kv_events_replay_to_the_full_blocks_cached(self) -> None:
        """Stored and removed blocks, applied in order, give exactly the blocks whose every
        token the model holds (hashes recomputed from the tokens, as a router would)."""
        if not hasattr(self, "cache"):
            return
        wire = msgpack.unpackb(msgspec.msgpack.encode(self.events.take()))
        apply_events(wire, self.published)
        expected = {
            block_hashes(prefix, ns, KV_BLOCK_SIZE)[-1]
            for ns, prefix in self.slot_of
            if len(prefix) % KV_BLOCK_SIZE == 0
        }
        assert self.published == expected


RadixCacheVersusBruteForce.TestCase.settings = settings(max_examples=300, stateful_step_count=40)
test_radix_cache_matches_brute_force_model = RadixCacheVersusBruteForce.TestCase
