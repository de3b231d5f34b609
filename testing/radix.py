"""Prefix caches over small CPU pools — no model, no KV tensors — for the cache and
scheduler tests and `benchmarks/radix_bench.py`."""

from __future__ import annotations

import torch

from engine.cache.base_prefix_cache import BasePrefixCache
from engine.cache.chunk_cache import ChunkCache
from engine.cache.kv_events import block_hashes
from engine.cache.namespace import PrefixNamespace
from engine.cache.radix_cache import RadixCache, _parent
from engine.cache.radix_key import RadixKey
from engine.cache.swa_radix_cache import SWARadixCache
from engine.cache.tree_node import TreeNode
from engine.mem.allocator import TokenToKVPoolAllocator
from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.mem.swa_allocator import SWATokenToKVPoolAllocator
from engine.sched.cache_manager import CacheManager


def simulated_cache(
    num_slots: int = 64,
    max_reqs: int = 8,
    max_context_len: int = 64,
    eviction_policy: str = "lru",
    disable_radix_cache: bool = False,
    swa_slots: int | None = None,
    sliding_window: int | None = None,
    window_checkpoints: bool = True,
) -> CacheManager:
    """A CacheManager over a `num_slots`-slot allocator and a `max_reqs`-row table, with a
    RadixCache (or, with `disable_radix_cache`, a ChunkCache) as the scheduler builds it;
    with `swa_slots`, a hybrid model's two pools and an SWARadixCache, for layers of
    `sliding_window` (`window_checkpoints` as `SWARadixCache` takes it)."""
    allocator = (
        TokenToKVPoolAllocator(num_slots)
        if swa_slots is None
        else SWATokenToKVPoolAllocator(num_slots, swa_slots)
    )
    tree: BasePrefixCache
    if disable_radix_cache:
        tree = ChunkCache(allocator.device)
    elif isinstance(allocator, SWATokenToKVPoolAllocator) and sliding_window is not None:
        tree = SWARadixCache(allocator, sliding_window, eviction_policy, window_checkpoints)
    else:
        tree = RadixCache(allocator, eviction_policy)
    return CacheManager(ReqToTokenPool(max_reqs, max_context_len), allocator, tree, sliding_window)


def insert_fresh(
    cache: CacheManager, tokens: list[int], extra_key: PrefixNamespace | None = None
) -> torch.Tensor:
    """Insert `tokens` with newly allocated slots, freeing as callers must the duplicates
    and what the cache did not keep; returns the slots allocated."""
    slots = cache.allocator.alloc(len(tokens))
    if slots is None:
        raise RuntimeError(f"{len(tokens)} slots needed, {cache.allocator.available_size()} free")
    inserted = cache.tree_cache.insert(RadixKey(tokens, extra_key), slots)
    cache.allocator.free(slots[: inserted.prefix_len])
    cache.allocator.free(slots[inserted.kept_len :])
    return slots


def total_size(tree: BasePrefixCache) -> int:
    """Tokens the cache holds, counted from its slots rather than its ledgers."""
    return len(tree.cached_slots())


def tree_blocks(tree: RadixCache, block_size: int) -> set[int]:
    """Every full block on every root→node path of the tree, hashed from its tokens: what
    the KV-cache events must add up to."""
    blocks: set[int] = set()
    paths: dict[TreeNode, list[int]] = {tree.root_node: []}
    for node in tree._nodes():  # parents before children
        path = paths[_parent(node)] + node.key.tolist()
        paths[node] = path
        blocks.update(block_hashes(path, node.key.extra_key, block_size))
    return blocks
