"""RadixAttention's prefix cache: a radix tree whose edges are token runs and whose
values are the KV slots holding those tokens' K/V.

A finished request leaves its KV in the tree instead of freeing it; a later request
that shares a prefix matches it and skips that much prefill. The tree also keeps the
two size ledgers the scheduler budgets with: `evictable_size_` (unlocked, can be freed
on demand) and `protected_size_` (locked by running requests).
"""

from __future__ import annotations

import heapq
import itertools
import sys
import time
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator
from typing import Any, NamedTuple

import torch

from engine.cache.evict_policy import get_evict_key
from engine.cache.radix_key import RadixKey
from engine.mem.allocator import TokenToKVPoolAllocator
from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.sched.req import Req


class TreeNode:
    """One edge of the tree: a run of tokens (`key`) and their KV slots (`value`).

    `lock_ref` counts the running requests whose matched prefix passes through this node;
    a locked node is never evicted. The timestamps, `hit_count` and `priority` feed the
    eviction policies.
    """

    __slots__ = (
        "id",
        "children",
        "parent",
        "key",
        "value",
        "lock_ref",
        "last_access_time",
        "creation_time",
        "hit_count",
        "priority",
    )
    _next_id = itertools.count()

    def __init__(
        self, key: RadixKey, value: torch.Tensor, parent: TreeNode | None, priority: int = 0
    ):
        self.id = next(TreeNode._next_id)
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value: torch.Tensor | None = value
        self.lock_ref = 0
        self.last_access_time = self.creation_time = time.monotonic()
        self.hit_count = 0
        self.priority = priority

    @property
    def evicted(self) -> bool:
        return self.value is None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, key={self.key!r}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    device_indices: torch.Tensor
    """KV slots of the longest cached prefix (int64, possibly empty)."""
    last_node: TreeNode
    """Deepest node of the match: lock it to pin the prefix."""


class RadixCache:
    """The radix tree over KV slots, with SGLang's public surface."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
        disable: bool = False,
        eviction_policy: str = "lru",
    ):
        if page_size != 1:
            raise ValueError(
                f"page_size={page_size}: only token-granular slots (page_size=1) are supported"
            )
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self.eviction_policy = eviction_policy
        self.evict_key = get_evict_key(eviction_policy)
        self.device = token_to_kv_pool_allocator.device
        self.evicted_tokens = 0
        """Tokens evicted since creation; a counter, so `reset` leaves it alone."""
        self.reset()

    @classmethod
    def create_simulated(
        cls, num_slots: int = 64, max_reqs: int = 8, max_context_len: int = 64, **kwargs
    ) -> RadixCache:
        """A cache over small CPU pools: no model, no KV tensors, for experiments and tests."""
        return cls(
            ReqToTokenPool(max_reqs, max_context_len), TokenToKVPoolAllocator(num_slots), **kwargs
        )

    def reset(self) -> None:
        """Drop the whole tree. Its slots are not freed: pair with the allocator's `clear()`."""
        self.root_node = TreeNode(RadixKey([]), self._empty_indices(), None, priority=-sys.maxsize)
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves: set[TreeNode] = set()
        self.evict_heap: list[tuple[Any, int, TreeNode]] = []

    # ----- match and insert -------------------------------------------------------------

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached prefix of `key` within its namespace.

        When the match ends inside an edge, that edge is split there and the match stops:
        the tokens after the split point belong to a different context, so nothing below
        that edge may be matched (the bug SGLang fixed 8 days after its first release).
        """
        if self.disable or len(key) == 0:
            return MatchResult(self._empty_indices(), self.root_node)
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
        return MatchResult(indices, node)

    def insert(
        self, key: RadixKey, value: torch.Tensor, priority: int = 0, chunked: bool = False
    ) -> int:
        """Insert `key` with KV slots `value`; return how many leading tokens were already cached.

        The caller owns `value[:returned]` as duplicates of what the tree holds and frees
        them. `chunked` marks a chunked-prefill self-insert, which must not count as a hit
        (a long request would otherwise inflate its own nodes' hit counts).
        """
        if self.disable:
            return len(key)
        if len(value) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(value)} slots")
        now = time.monotonic()
        node = self.root_node
        node.last_access_time = now
        present = 0
        while len(key):
            child = node.children.get(key.child_key())
            if child is None:
                self._add_leaf(node, key, value, priority)
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
        return present

    # ----- request hooks --------------------------------------------------------------

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Hand a finished request's KV to the tree and release its row.

        The request's committed tokens (input + output[:-1]: the last sampled token was
        never forwarded, so it has no KV) go into the tree; slots duplicating what the tree
        already held are freed at once, as are slots allocated but never written. With
        `is_insert=False` (retraction, abort) every slot the request owns is freed instead.
        """
        row = req.req_pool_idx
        indices = self.req_to_token_pool.req_to_token[row, : req.kv_allocated_len].to(torch.int64)
        if self.disable or not is_insert:
            self.token_to_kv_pool_allocator.free(indices[len(req.prefix_indices) :])
        else:
            kv_len = req.kv_committed_len
            key = RadixKey(req.all_token_ids()[:kv_len], req.extra_key)
            present = self.insert(key, indices[:kv_len], req.priority)
            self.token_to_kv_pool_allocator.free(indices[len(req.prefix_indices) : present])
            self.token_to_kv_pool_allocator.free(indices[kv_len:])
        self._unlock(req)
        self.req_to_token_pool.free(row)
        req.req_pool_idx = None
        req.prefix_indices = self._empty_indices()
        req.kv_allocated_len = req.kv_committed_len = 0

    def cache_unfinished_req(self, req: Req, chunked: bool = True) -> None:
        """Insert a running request's committed KV so others can share it mid-flight.

        Duplicate slots are freed and the request's row is repointed at the tree's copy,
        so one prefix has one copy; the request then locks its new, longer prefix.
        """
        if self.disable:
            return
        row = req.req_pool_idx
        kv_len = req.kv_committed_len
        indices = self.req_to_token_pool.req_to_token[row, :kv_len].to(torch.int64)
        key = RadixKey(req.all_token_ids()[:kv_len], req.extra_key)
        owned_from = len(req.prefix_indices)
        present = self.insert(key, indices, req.priority, chunked=chunked)
        self.token_to_kv_pool_allocator.free(indices[owned_from:present])
        new_indices, new_last_node = self.match_prefix(key)
        self.req_to_token_pool.write(row, owned_from, new_indices[owned_from:])
        self.inc_lock_ref(new_last_node)
        self._unlock(req)
        req.prefix_indices, req.last_node = new_indices, new_last_node

    def _unlock(self, req: Req) -> None:
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
            req.last_node = None

    # ----- locking and eviction ---------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path root→node; return the change in evictable size (≤ 0)."""
        if self.disable:
            return 0
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 0:
                size = len(node.key)
                self.evictable_size_ -= size
                self.protected_size_ += size
                delta -= size
                self.evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlock the path root→node; return the change in evictable size (≥ 0)."""
        if self.disable:
            return 0
        if node is not self.root_node and node.lock_ref == 0:
            raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
        delta = 0
        while node is not self.root_node:
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
        if self.disable or num_tokens <= 0:
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

    # ----- sizes ------------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        """Tokens held by the tree, counted by walking it (a debugging aid)."""
        return sum(len(n.key) for n in self._nodes())

    # ----- tree surgery -----------------------------------------------------------------

    def _add_leaf(
        self, parent: TreeNode, key: RadixKey, value: torch.Tensor, priority: int
    ) -> None:
        leaf = TreeNode(key, value, parent, priority)
        parent.children[key.child_key()] = leaf
        self.evictable_leaves.discard(parent)
        self._add_evictable_leaf(leaf)
        self.evictable_size_ += len(key)

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
        upper = TreeNode(
            child.key[:split_len], child.value[:split_len], child.parent, child.priority
        )
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        upper.last_access_time = child.last_access_time
        upper.creation_time = child.creation_time
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.parent = upper
        upper.children[child.key.child_key()] = child
        upper.parent.children[upper.key.child_key()] = upper
        return upper

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[node.key.child_key()]
        self.evictable_size_ -= len(node.key)
        self.evictable_leaves.discard(node)
        node.value = None
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

    # ----- debugging --------------------------------------------------------------------

    def check_integrity(self, reqs: Iterable[Req] = ()) -> None:
        """Raise AssertionError unless the tree, the ledgers and the pools agree.

        Every KV slot 1..size is accounted exactly once among the allocator's free list,
        the tree, and the slots the given running requests own; `evictable + protected ==
        total`; the evictable-leaf set is exactly the unlocked leaves; each request's row
        starts with its locked tree prefix.
        """

        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise AssertionError(msg)

        evictable = protected = 0
        leaves: set[TreeNode] = set()
        slots: list[torch.Tensor] = [self.token_to_kv_pool_allocator.free_slots()]
        for node in self._nodes():
            size = len(node.key)
            check(
                size > 0 and node.value is not None and len(node.value) == size,
                f"{node!r}: bad key/value",
            )
            check(
                node.parent.children.get(node.key.child_key()) is node,
                f"{node!r}: not its parent's child",
            )
            if node.parent is not self.root_node:
                check(
                    node.key.extra_key == node.parent.key.extra_key,
                    f"{node!r}: namespace differs from parent's",
                )
            check(
                node.lock_ref >= sum(c.lock_ref for c in node.children.values()),
                f"{node!r}: lock below children's",
            )
            if node.lock_ref > 0:
                protected += size
            else:
                evictable += size
                if not node.children:
                    leaves.add(node)
            slots.append(node.value)
        check(
            evictable == self.evictable_size_,
            f"evictable_size_ {self.evictable_size_} != {evictable} in tree",
        )
        check(
            protected == self.protected_size_,
            f"protected_size_ {self.protected_size_} != {protected} in tree",
        )
        check(
            leaves == self.evictable_leaves,
            "evictable_leaves differs from the tree's unlocked leaves",
        )
        keyed = {
            node
            for key, _, node in self.evict_heap
            if node in leaves and key == self.evict_key(node)
        }
        check(keyed == leaves, "an evictable leaf has no eviction-heap entry under its current key")

        table = self.req_to_token_pool.req_to_token
        free_rows = set(self.req_to_token_pool.free_slots)
        for req in reqs:
            row = req.req_pool_idx
            check(
                row is not None and row not in free_rows, f"request {req.rid} has no allocated row"
            )
            prefix_len = len(req.prefix_indices)
            held = table[row, : req.kv_allocated_len].to(torch.int64)
            check(
                torch.equal(held[:prefix_len].cpu(), req.prefix_indices.cpu()),
                f"request {req.rid}: row != prefix",
            )
            if prefix_len:
                check(
                    req.last_node is not None and req.last_node.lock_ref > 0,
                    f"request {req.rid}: prefix unlocked",
                )
                check(
                    torch.equal(self._path_value(req.last_node).cpu(), req.prefix_indices.cpu()),
                    f"request {req.rid}: prefix is not its last_node's path",
                )
            slots.append(held[prefix_len:])

        counts = Counter(torch.cat(slots).tolist())
        size = self.token_to_kv_pool_allocator.size
        check(
            set(counts) == set(range(1, size + 1)),
            f"slots unaccounted: {sorted(set(range(1, size + 1)) - set(counts))[:10]}"
            f", foreign: {sorted(set(counts) - set(range(1, size + 1)))[:10]}",
        )
        check(
            max(counts.values(), default=1) == 1,
            f"slots held twice: {[s for s, c in counts.items() if c > 1][:10]}",
        )

    def _path_value(self, node: TreeNode) -> torch.Tensor:
        values = []
        while node is not self.root_node:
            values.append(node.value)
            node = node.parent
        return torch.cat(values[::-1]) if values else self._empty_indices()

    def pretty_print(self) -> None:
        """Print the tree: each edge's tokens, length, lock count and hits."""
        lines: list[str] = []
        stack = [(child, 1) for child in reversed(self.root_node.children.values())]
        while stack:
            node, depth = stack.pop()
            namespace = f" ns={node.key.extra_key!r}" if node.key.extra_key is not None else ""
            lines.append(
                f"{'  ' * depth}{node.key.tolist()} len={len(node.key)} "
                f"lock_ref={node.lock_ref} hits={node.hit_count}{namespace}"
            )
            stack.extend((child, depth + 1) for child in reversed(node.children.values()))
        print("root")
        print("\n".join(lines))
        print(
            f"#tokens: {self.total_size()}, evictable: {self.evictable_size_}, protected: {self.protected_size_}"
        )


def demo() -> None:
    """The seed's cheapest experiment: a few sequences, one locked request, printed."""
    cache = RadixCache.create_simulated()
    allocator = cache.token_to_kv_pool_allocator
    for tokens in ([1, 2, 3], [1, 2, 4, 5], [1, 2, 4, 5, 6, 7], [8, 9, 10, 11, 12]):
        slots = allocator.alloc(len(tokens))
        present = cache.insert(RadixKey(tokens), slots)
        allocator.free(slots[:present])
    match = cache.match_prefix(RadixKey([1, 2, 4, 5, 6, 99]))
    cache.inc_lock_ref(match.last_node)
    print(
        f"match [1, 2, 4, 5, 6, 99] -> slots {match.device_indices.tolist()} (the edge [6, 7] was split)"
    )
    cache.pretty_print()
    cache.check_integrity()


if __name__ == "__main__":
    demo()
