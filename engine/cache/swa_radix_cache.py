"""The radix tree of a hybrid model (SGLang's `SWARadixCache`): every cached token keeps its
full-attention KV, and its sliding-window KV only while it may still be read.

A query at position p reads the sliding layers' K/V of the `window - 1` tokens before it
(`CacheManager.free_out_of_window` frees a request's own beyond that). So a cached prefix is
usable up to p only where those tokens still have SWA KV; older SWA KV can go first, long
before the full KV of the same tokens. A node whose SWA KV went is an SWA tombstone: its
full KV stays, a match may pass through it, but may not end within a window of it.

The tree keeps SWA KV only where a match can end on it: the window before each inserted
key's end (where a conversation goes on), and with window checkpoints the window before
each branch point on the key's path (where a shared prefix ends: a fan-out's later requests
hit it, though the request that first branched off recomputed it). The rest of an inserted
path's SWA KV is freed at the insert, unless a running request's match still reads it.
"""

from __future__ import annotations

import heapq

import torch

from engine.cache.base_prefix_cache import (
    CacheHandle,
    InsertResult,
    MatchResult,
    check_invariant,
)
from engine.cache.radix_cache import RadixCache, _node
from engine.cache.radix_key import RadixKey
from engine.cache.tree_node import TreeNode
from engine.mem.swa_allocator import SWATokenToKVPoolAllocator


class SWATreeNode(TreeNode):
    """A tree node that also knows whether its tokens' SWA KV is live, and how many locked
    matches still read it (`swa_lock_ref` ≤ `lock_ref`: only a match's last window)."""

    __slots__ = ("swa_tombstone", "swa_lock_ref")

    def __init__(
        self, key: RadixKey, value: torch.Tensor, parent: TreeNode | None, priority: int = 0
    ) -> None:
        super().__init__(key, value, parent, priority)
        self.swa_tombstone = False
        self.swa_lock_ref = 0


class SWARadixCache(RadixCache):
    """`RadixCache` over a hybrid model's two pools, with an SWA state per node.

    Ledgers: the full pool's are `RadixCache`'s; the SWA pool's are `swa_evictable_size_`
    (live, not read by a locked match's window) and `swa_protected_size_`. `evict` frees
    leaves of both pools as `RadixCache` does; `evict_swa` tombstones live nodes in LRU
    order wherever they sit, freeing their SWA slots only.
    """

    node_type = SWATreeNode

    def __init__(
        self,
        token_to_kv_pool_allocator: SWATokenToKVPoolAllocator,
        sliding_window: int,
        eviction_policy: str = "lru",
        window_checkpoints: bool = True,
    ) -> None:
        """`window_checkpoints` off keeps only the windows before keys' ends: SGLang's and
        vLLM's design, where a prefix shared past its window is recomputed every time."""
        self.swa_allocator = token_to_kv_pool_allocator
        self.swa_tail = sliding_window - 1
        """Tokens before a query whose SWA KV it reads: a match must end after this many
        live ones (or after all, live from the root), and a lock protects this many."""
        self.window_checkpoints = window_checkpoints
        super().__init__(token_to_kv_pool_allocator, eviction_policy)

    def reset(self) -> None:
        super().reset()
        self.swa_evictable_size_ = 0
        self.swa_protected_size_ = 0
        self.swa_evict_heap: list[tuple[float, int, SWATreeNode]] = []
        """Lazy LRU heap of live, SWA-unlocked nodes: an entry is pushed when a node becomes
        one, and re-pushed under the node's current access time when popped stale."""
        self._swa_heap_limit = 1024

    # ----- match and insert -------------------------------------------------------------

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """The longest prefix of the full-KV match whose last `window - 1` tokens (or all,
        from the root) have live SWA KV; the rest is recomputed. Such a prefix always ends
        at a node's end, so the handle's path is exactly the match."""
        indices, end, _ = super().match_prefix(key)
        path: list[SWATreeNode] = []
        node = _swa_node(_node(end))
        while node.parent is not None:
            path.append(node)
            node = _swa_node(node.parent)
        best, best_len, pos, run_start = node, 0, 0, 0
        for node in reversed(path):
            pos += len(node.key)
            if node.swa_tombstone:
                run_start = pos
            elif run_start == 0 or pos - run_start >= self.swa_tail:
                best, best_len = node, pos
        return MatchResult(indices[:best_len], best, len(indices))

    def insert(
        self,
        key: RadixKey,
        value: torch.Tensor,
        priority: int = 0,
        chunked: bool = False,
        swa_live_from: int = 0,
    ) -> InsertResult:
        """`RadixCache.insert`, then the SWA state of the key's path: new tokens before
        `swa_live_from` become tombstones; cached tombstones from it on take the caller's
        live SWA slots (`move_swa`), so the caller frees its duplicates as full slots only.
        Last, the path keeps live SWA only where a match can end on it (`_drop_unmatchable`)."""
        inserted = super().insert(key, value, priority, chunked)
        node, pos, rest = self.root_node, 0, key
        while len(rest):
            child = _swa_node(node.children[rest.child_key()])
            end = pos + len(child.key)
            fresh = pos >= inserted.prefix_len  # the leaf this insert added
            if (fresh or child.swa_tombstone) and pos < swa_live_from < end:
                child = _swa_node(self._split_node(child, swa_live_from - pos))
                end = swa_live_from
            if fresh and end <= swa_live_from:
                self._tombstone(child)
            elif not fresh and child.swa_tombstone and pos >= swa_live_from:
                self.swa_allocator.move_swa(value[pos:end], child.value)
                child.swa_tombstone = False
                self.swa_evictable_size_ += len(child.key)
                self._push_swa_entry(child)
            node, pos, rest = child, end, rest[end - pos :]
        self._drop_unmatchable(key)
        return inserted

    def _drop_unmatchable(self, key: RadixKey) -> None:
        """Tombstone the SWA KV of the key's path outside the windows before its end and
        (with checkpoints) before its branch points, except what a running match reads.

        A window ends at a node's end, so the part of a node it covers is a suffix: the node
        splits there, and its upper part goes."""
        path: list[tuple[SWATreeNode, int]] = []  # each node on the path, and its end
        node, pos, rest = _swa_node(self.root_node), 0, key
        while len(rest):
            node = _swa_node(node.children[rest.child_key()])
            pos += len(node.key)
            path.append((node, pos))
            rest = rest[len(node.key) :]
        window_start, freed = len(key) - self.swa_tail, []
        for node, end in reversed(path):
            if self.window_checkpoints and len(node.children) > 1:
                window_start = min(window_start, end - self.swa_tail)
            start = end - len(node.key)
            if not _swa_evictable(node) or window_start <= start:
                continue
            if window_start < end:
                node = _swa_node(self._split_node(node, window_start - start))
            freed.append(node.value)
            self._tombstone(node)
        if freed:
            self.swa_allocator.free_swa(torch.cat(freed))

    # ----- locking and eviction ---------------------------------------------------------

    def inc_lock_ref(self, handle: CacheHandle) -> int:
        """Lock the path's full KV, and the SWA KV of its last `window - 1` tokens (the
        node holding the oldest of them is split there, so a lock covers whole nodes)."""
        delta = super().inc_lock_ref(handle)
        node, locked = _swa_node(_node(handle)), 0
        while node.parent is not None and locked < self.swa_tail:
            if locked + len(node.key) > self.swa_tail:
                self._split_node(node, locked + len(node.key) - self.swa_tail)
            check_invariant(not node.swa_tombstone, f"{node!r}: locking a tombstone's SWA")
            if node.swa_lock_ref == 0:
                self.swa_evictable_size_ -= len(node.key)
                self.swa_protected_size_ += len(node.key)
            node.swa_lock_ref += 1
            locked += len(node.key)
            node = _swa_node(node.parent)
        return delta

    def dec_lock_ref(self, handle: CacheHandle) -> int:
        """Unlock what `inc_lock_ref` locked: splits since never merge nodes, so the same
        whole nodes make up the last `window - 1` tokens."""
        delta = super().dec_lock_ref(handle)
        node, unlocked = _swa_node(_node(handle)), 0
        while node.parent is not None and unlocked < self.swa_tail:
            node.swa_lock_ref -= 1
            if node.swa_lock_ref == 0:
                self.swa_evictable_size_ += len(node.key)
                self.swa_protected_size_ -= len(node.key)
                self._push_swa_entry(node)
            unlocked += len(node.key)
            node = _swa_node(node.parent)
        return delta

    def evict_swa(self, num_tokens: int) -> int:
        """Tombstone live, SWA-unlocked nodes, least recently used first, until at least
        `num_tokens` SWA slots are freed or none is left; return how many were freed."""
        freed: list[torch.Tensor] = []
        num_evicted = 0
        while num_evicted < num_tokens and self.swa_evict_heap:
            accessed, _, node = heapq.heappop(self.swa_evict_heap)
            if not _swa_evictable(node):
                continue
            if accessed != node.last_access_time:  # used since: back under its new time
                heapq.heappush(self.swa_evict_heap, (node.last_access_time, node.id, node))
                continue
            freed.append(node.value)
            num_evicted += len(node.key)
            self._tombstone(node)
        if freed:
            self.swa_allocator.free_swa(torch.cat(freed))
        return num_evicted

    # ----- sizes ------------------------------------------------------------------------

    def swa_evictable_size(self) -> int:
        return self.swa_evictable_size_

    def swa_protected_size(self) -> int:
        return self.swa_protected_size_

    def cached_swa_slots(self) -> torch.Tensor:
        values = [n.value for n in self._nodes() if not _swa_node(n).swa_tombstone]
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
        leaf = _swa_node(super()._add_leaf(parent, key, value, priority, path))
        self.swa_evictable_size_ += len(key)
        self._push_swa_entry(leaf)
        return leaf

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        lower = _swa_node(child)
        upper = _swa_node(super()._split_node(child, split_len))
        upper.swa_tombstone = lower.swa_tombstone
        upper.swa_lock_ref = lower.swa_lock_ref
        if _swa_evictable(upper):
            self._push_swa_entry(upper)
        return upper

    def _delete_leaf(self, node: TreeNode) -> None:
        leaf = _swa_node(node)
        if not leaf.swa_tombstone:  # its SWA slots go with its full ones
            self.swa_evictable_size_ -= len(leaf.key)
            leaf.swa_tombstone = True
        super()._delete_leaf(leaf)

    def _tombstone(self, node: SWATreeNode) -> None:
        """Mark a live, SWA-unlocked node's SWA KV gone; its slots are the caller's."""
        node.swa_tombstone = True
        self.swa_evictable_size_ -= len(node.key)

    def _push_swa_entry(self, node: SWATreeNode) -> None:
        heapq.heappush(self.swa_evict_heap, (node.last_access_time, node.id, node))
        if len(self.swa_evict_heap) > self._swa_heap_limit:
            self.swa_evict_heap = [
                (n.last_access_time, n.id, n)
                for n in map(_swa_node, self._nodes())
                if _swa_evictable(n)
            ]
            heapq.heapify(self.swa_evict_heap)
            self._swa_heap_limit = 2 * len(self.swa_evict_heap) + 1024

    # ----- integrity --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """`RadixCache.check_integrity`, and: a node's SWA lock never exceeds its lock nor
        sits on a tombstone; live nodes map every slot to an SWA slot and tombstones none;
        the SWA ledgers add up; every live, SWA-unlocked node has an SWA heap entry."""
        super().check_integrity()
        evictable = protected = 0
        live: list[torch.Tensor] = []
        dead: list[torch.Tensor] = []
        for node in map(_swa_node, self._nodes()):
            check_invariant(node.swa_lock_ref <= node.lock_ref, f"{node!r}: SWA lock > lock")
            if node.swa_tombstone:
                check_invariant(node.swa_lock_ref == 0, f"{node!r}: tombstone SWA-locked")
                dead.append(node.value)
                continue
            live.append(node.value)
            if node.swa_lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        mapping = self.swa_allocator.full_to_swa_index_mapping
        empty = self._empty_indices()
        check_invariant(
            bool(mapping[torch.cat([empty, *live])].all()), "a live node's slot has no SWA slot"
        )
        check_invariant(not mapping[torch.cat([empty, *dead])].any(), "a tombstone has SWA")
        check_invariant(
            (evictable, protected) == (self.swa_evictable_size_, self.swa_protected_size_),
            f"SWA ledgers {self.swa_evictable_size_}, {self.swa_protected_size_} != "
            f"{evictable}, {protected} in tree",
        )
        queued = {n for _, _, n in self.swa_evict_heap}
        check_invariant(
            all(n in queued for n in map(_swa_node, self._nodes()) if _swa_evictable(n)),
            "a live, SWA-unlocked node has no SWA heap entry",
        )


def _swa_node(node: TreeNode) -> SWATreeNode:
    """The SWA tree's own kind of node."""
    if not isinstance(node, SWATreeNode):
        raise TypeError(f"{node!r} is not an SWA radix tree's node")
    return node


def _swa_evictable(node: SWATreeNode) -> bool:
    return not node.swa_tombstone and node.swa_lock_ref == 0
