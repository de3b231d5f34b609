"""A node of the radix tree (`RadixCache`): an edge of tokens with their KV slots, and the
radix cache's `CacheHandle`: a match ends at a node."""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable

import torch

from engine.cache.radix_key import RadixKey


class TreeNode:
    """One edge of the tree: a run of tokens (`key`) and their KV slots (`value`).

    `lock_ref` counts the running requests whose matched prefix passes through this node;
    a locked node is never evicted. The timestamps, `hit_count` and `priority` feed the
    eviction policies. Only the root has no parent.
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
    ) -> None:
        self.id: int = next(TreeNode._next_id)
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time: float = time.monotonic()
        self.creation_time: float = self.last_access_time
        self.hit_count: int = 0
        self.priority: int = priority

    def matched_indices(self) -> torch.Tensor:
        """The slots of the path root→node, in token order."""
        values = []
        node = self
        while node.parent is not None:
            values.append(node.value)
            node = node.parent
        return torch.cat(values[::-1]) if values else node.value

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, key={self.key!r}, lock_ref={self.lock_ref})"
