"""Eviction priorities: each policy maps a tree node to a key; the smallest goes first."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.cache.tree_node import TreeNode

SLRU_PROTECTED_HITS = 2
"""SLRU: a node with at least this many hits sits in the protected segment."""

EvictKey = Callable[["TreeNode"], Any]

EVICTION_POLICIES: dict[str, EvictKey] = {
    "lru": lambda n: n.last_access_time,
    "lfu": lambda n: (n.hit_count, n.last_access_time),
    "slru": lambda n: (n.hit_count >= SLRU_PROTECTED_HITS, n.last_access_time),
    "priority": lambda n: (n.priority, n.last_access_time),
    "fifo": lambda n: n.creation_time,
    "filo": lambda n: -n.creation_time,
    "mru": lambda n: -n.last_access_time,
}


def get_evict_key(policy: str) -> EvictKey:
    try:
        return EVICTION_POLICIES[policy.lower()]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {policy!r}; choose one of {', '.join(EVICTION_POLICIES)}"
        ) from None
