"""RadixAttention's prefix cache: a radix tree whose edges are token runs and whose
values are the KV slots holding those tokens' K/V.

A finished request leaves its KV in the tree instead of freeing it; a later request
that shares a prefix matches it and skips that much prefill. The tree also keeps the
two size ledgers the scheduler budgets with: `evictable_size_` (unlocked, can be freed
on demand) and `protected_size_` (locked by running requests). The tree holds keys and
slots only; the scheduler's `CacheManager` decides what goes in and comes out of it.
"""

from __future__ import annotations

import heapq
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from engine.cache.base_prefix_cache import (
    BasePrefixCache,
    CacheHandle,
    InsertResult,
    MatchResult,
    check_invariant,
)
from engine.cache.evict_policy import get_evict_key
from engine.cache.kv_events import BlockEventRecorder
from engine.cache.namespace import PrefixNamespace
from engine.cache.radix_key import RadixKey
from engine.cache.tree_node import TreeNode
from engine.mem.allocator import TokenToKVPoolAllocator

T = TypeVar("T")


class RadixCache(BasePrefixCache):
    """The radix tree over KV slots, with SGLang's public surface. Evicted slots go back to
    `token_to_kv_pool_allocator`. Its handles are its `TreeNode`s."""

    disable = False
    node_type: type[TreeNode] = TreeNode
    """The class of the tree's nodes: a subclass may keep more per node."""

    def __init__(
        self, token_to_kv_pool_allocator: TokenToKVPoolAllocator, eviction_policy: str = "lru"
    ) -> None:
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.eviction_policy = eviction_policy
        self.evict_key = get_evict_key(eviction_policy)
        self.device = token_to_kv_pool_allocator.device
        self.evicted_tokens = 0
        self.kv_events: BlockEventRecorder | None = None
        """Records the tree as KV-cache events once `attach_kv_events` is called."""
        self.reset()

    def reset(self) -> None:
        self.root_node = self.node_type(
            RadixKey([]), self._empty_indices(), None, priority=-sys.maxsize
        )
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves: set[TreeNode] = set()
        self.evict_heap: list[tuple[Any, int, TreeNode]] = []
        if self.kv_events is not None:
            self.kv_events.on_reset()

    def attach_kv_events(self, recorder: BlockEventRecorder) -> None:
        if self.root_node.children:
            raise RuntimeError("attach_kv_events on a tree that already holds prefixes")
        self.kv_events = recorder
        recorder.on_reset()

    # ----- match and insert -------------------------------------------------------------

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached prefix of `key` within its namespace.

        When the match ends inside an edge, that edge is split there and the match stops:
        the tokens after the split point belong to a different context, so nothing below
        that edge may be matched (the bug SGLang fixed 8 days after its first release).
        """
        if len(key) == 0:
            return MatchResult(self._empty_indices(), self.root_node, 0)
        now = time.monotonic()
        node = self.root_node
        node.last_access_time = now
        values: list[torch.Tensor] = []
        while len(key):
            child = node.children.get(key.child_key())
            if child is None:
                break
            prefix_len = child.key.match(key)
            if prefix_len < len(child.key):
                node = self._split_node(child, prefix_len)
                node.last_access_time = now
                values.append(node.value)
                break
            child.last_access_time = now
            self._refresh_evict_key(child)
            values.append(child.value)
            node = child
            key = key[prefix_len:]
        indices = torch.cat(values) if values else self._empty_indices()
        return MatchResult(indices, node, len(indices))

    def insert(
        self,
        key: RadixKey,
        value: torch.Tensor,
        priority: int = 0,
        chunked: bool = False,
        swa_live_from: int = 0,
    ) -> InsertResult:
        """Insert `key` with KV slots `value`; the tree keeps the whole key.

        The caller owns `value[:prefix_len]` as duplicates of what the tree holds and frees
        them. `chunked` marks a chunked-prefill self-insert, which must not count as a hit
        (a long request would otherwise inflate its own nodes' hit counts).
        """
        if len(value) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(value)} slots")
        total, path = len(key), key.token_ids
        now = time.monotonic()
        node = self.root_node
        node.last_access_time = now
        present = 0
        while len(key):
            child = node.children.get(key.child_key())
            if child is None:
                self._add_leaf(node, key, value, priority, path)
                break
            prefix_len = child.key.match(key)
            if prefix_len < len(child.key):
                child = self._split_node(child, prefix_len)
            child.last_access_time = now
            child.priority = max(child.priority, priority)
            if not chunked:
                child.hit_count += 1
            self._refresh_evict_key(child)
            present += prefix_len
            node = child
            key, value = key[prefix_len:], value[prefix_len:]
        return InsertResult(present, total)

    # ----- locking and eviction ---------------------------------------------------------

    def inc_lock_ref(self, handle: CacheHandle) -> int:
        """Lock the path root→node; return the change in evictable size (≤ 0)."""
        node = _node(handle)
        delta = 0
        while node.parent is not None:  # up to, not including, the root
            if node.lock_ref == 0:
                size = len(node.key)
                self.evictable_size_ -= size
                self.protected_size_ += size
                delta -= size
                self.evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, handle: CacheHandle) -> int:
        """Unlock the path root→node; return the change in evictable size (≥ 0)."""
        node = _node(handle)
        if node.parent is not None and node.lock_ref == 0:
            raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
        delta = 0
        while node.parent is not None:
            if node.lock_ref == 1:
                size = len(node.key)
                self.evictable_size_ += size
                self.protected_size_ -= size
                delta += size
                if not node.children:
                    self._add_evictable_leaf(node)
            node.lock_ref -= 1
            node = node.parent
        return delta

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves, if the tree has them.

        Leaves leave in the eviction policy's order; a parent left as an unlocked leaf
        joins the heap. Returns the number of slots freed.
        """
        if num_tokens <= 0:
            return 0
        freed: list[torch.Tensor] = []
        num_evicted = 0
        while num_evicted < num_tokens and self.evict_heap:
            key, _, node = heapq.heappop(self.evict_heap)
            if node not in self.evictable_leaves or key != self.evict_key(node):
                continue  # stale: locked, grew children, evicted, or re-keyed since
            freed.append(node.value)
            num_evicted += len(node.key)
            self._delete_leaf(node)
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        self.evicted_tokens += num_evicted
        return num_evicted

    def evict_namespace(self, namespace: PrefixNamespace) -> int:
        """Free every unlocked prefix of `namespace` (an unloaded LoRA adapter's), leaves
        first; returns the slots freed. A namespaced node's parent is the root or a node of
        the same namespace, so the walk never leaves it."""
        stack = [n for n in self.evictable_leaves if n.key.extra_key == namespace]
        freed: list[torch.Tensor] = []
        num_evicted = 0
        while stack:
            node = stack.pop()
            parent = _parent(node)
            freed.append(node.value)
            num_evicted += len(node.key)
            self._delete_leaf(node)
            if parent in self.evictable_leaves:
                stack.append(parent)
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        return num_evicted

    # ----- order ------------------------------------------------------------------------

    def dfs_weight_order(
        self, items: Sequence[T], handle: Callable[[T], CacheHandle | None]
    ) -> list[T]:
        items_at: dict[TreeNode, list[T]] = defaultdict(list)
        for item in items:
            matched = handle(item)
            items_at[self.root_node if matched is None else _node(matched)].append(item)
        weight: Counter[TreeNode] = Counter({node: len(at) for node, at in items_at.items()})
        for node in list(items_at):  # every item weighs on each ancestor once
            ancestor = node.parent
            while ancestor is not None:
                weight[ancestor] += len(items_at[node])
                ancestor = ancestor.parent
        order: list[T] = []
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            order.extend(items_at.get(node, ()))
            children = [c for c in node.children.values() if weight[c] > 0]
            stack.extend(sorted(children, key=lambda c: weight[c]))  # heaviest popped first
        return order

    # ----- sizes ------------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def cached_slots(self) -> torch.Tensor:
        values = [node.value for node in self._nodes()]
        return torch.cat(values) if values else self._empty_indices()

    # ----- tree surgery -----------------------------------------------------------------

    def _add_leaf(
        self,
        parent: TreeNode,
        key: RadixKey,
        value: torch.Tensor,
        priority: int,
        path: memoryview,
    ) -> TreeNode:
        """Hang `key` under `parent`; `path` is every token from the root to the leaf's end."""
        leaf = self.node_type(key, value, parent, priority)
        parent.children[key.child_key()] = leaf
        if self.kv_events is not None:
            self.kv_events.on_add_leaf(leaf, path)
        self.evictable_leaves.discard(parent)
        self._add_evictable_leaf(leaf)
        self.evictable_size_ += len(key)
        return leaf

    # The eviction heap is persistent and lazy: an entry is pushed whenever a node becomes
    # an unlocked leaf or an unlocked leaf's policy key changes, and entries that no longer
    # describe an unlocked leaf with that key are skipped when popped. `evict` thus costs
    # O(evicted log n) instead of a heap rebuild over every leaf per call.

    def _add_evictable_leaf(self, node: TreeNode) -> None:
        self.evictable_leaves.add(node)
        self._push_evict_entry(node)

    def _refresh_evict_key(self, node: TreeNode) -> None:
        if node in self.evictable_leaves:
            self._push_evict_entry(node)

    def _push_evict_entry(self, node: TreeNode) -> None:
        if len(self.evict_heap) > 2 * len(self.evictable_leaves) + 64:
            self.evict_heap = [(self.evict_key(n), n.id, n) for n in self.evictable_leaves]
            heapq.heapify(self.evict_heap)
        heapq.heappush(self.evict_heap, (self.evict_key(node), node.id, node))

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child`'s edge after `split_len` tokens; return the new upper half.

        The upper half inherits the lock count (every request through `child` passes
        through it) and the eviction metadata, so the size ledgers do not move.
        """
        parent = _parent(child)
        upper = self.node_type(
            child.key[:split_len], child.value[:split_len], parent, child.priority
        )
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        upper.last_access_time = child.last_access_time
        upper.creation_time = child.creation_time
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.parent = upper
        upper.children[child.key.child_key()] = child
        parent.children[upper.key.child_key()] = upper
        if self.kv_events is not None:
            self.kv_events.on_split(upper, child)
        return upper

    def _delete_leaf(self, node: TreeNode) -> None:
        """Detach an evicted leaf; its slots are the caller's to free."""
        parent = _parent(node)
        del parent.children[node.key.child_key()]
        self.evictable_size_ -= len(node.key)
        self.evictable_leaves.discard(node)
        node.value = self._empty_indices()  # stale heap entries must not pin the slots
        if self.kv_events is not None:
            self.kv_events.on_delete_leaf(node)
        if parent is not self.root_node and parent.lock_ref == 0 and not parent.children:
            self._add_evictable_leaf(parent)

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _empty_indices(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    # ----- integrity --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless the tree and its ledgers agree: every edge has as many
        slots as tokens, hangs under its first token and keeps its parent's namespace;
        locks never fall below a child's; `evictable + protected` equal the tree's size;
        the evictable-leaf set is exactly the unlocked leaves, each with an eviction-heap
        entry under its current key."""
        evictable = protected = 0
        leaves: set[TreeNode] = set()
        for node in self._nodes():
            size = len(node.key)
            parent = _parent(node)
            check_invariant(size > 0 and len(node.value) == size, f"{node!r}: bad key/value")
            check_invariant(
                parent.children.get(node.key.child_key()) is node,
                f"{node!r}: not its parent's child",
            )
            if parent is not self.root_node:
                check_invariant(
                    node.key.extra_key == parent.key.extra_key,
                    f"{node!r}: namespace differs from parent's",
                )
            check_invariant(
                node.lock_ref >= sum(c.lock_ref for c in node.children.values()),
                f"{node!r}: lock below children's",
            )
            if node.lock_ref > 0:
                protected += size
            else:
                evictable += size
                if not node.children:
                    leaves.add(node)
        check_invariant(
            evictable == self.evictable_size_,
            f"evictable_size_ {self.evictable_size_} != {evictable} in tree",
        )
        check_invariant(
            protected == self.protected_size_,
            f"protected_size_ {self.protected_size_} != {protected} in tree",
        )
        check_invariant(
            leaves == self.evictable_leaves,
            "evictable_leaves differs from the tree's unlocked leaves",
        )
        keyed = {
            node
            for key, _, node in self.evict_heap
            if node in leaves and key == self.evict_key(node)
        }
        check_invariant(
            keyed == leaves, "an evictable leaf has no eviction-heap entry under its current key"
        )


def token_only_tree() -> BasePrefixCache:
    """A radix tree of token keys alone, for counting the prefixes keys share (the
    scheduler's in-batch dedup): its slots are placeholders, never read nor evicted, so a
    one-slot allocator serves."""
    return RadixCache(TokenToKVPoolAllocator(1))


def _node(handle: CacheHandle) -> TreeNode:
    """The tree's own kind of handle; another cache's is a caller's bug."""
    if not isinstance(handle, TreeNode):
        raise TypeError(f"{handle!r} is not a radix tree's handle")
    return handle


def _parent(node: TreeNode) -> TreeNode:
    """The parent of a node below the root."""
    if node.parent is None:
        raise RuntimeError(f"{node!r} is the root")
    return node.parent
