"""The prefix cache that shares nothing, for `--disable-radix-cache` (SGLang's ChunkCache).

Every request prefills its whole prompt and frees all its slots when it finishes. It
exists so that the scheduler runs one code path with or without prefix sharing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from engine.cache.base_prefix_cache import (
    BasePrefixCache,
    CacheHandle,
    InsertResult,
    MatchResult,
)
from engine.cache.kv_events import BlockEventRecorder
from engine.cache.namespace import PrefixNamespace
from engine.cache.radix_key import RadixKey

T = TypeVar("T")


class EmptyHandle:
    """The handle of every match: the empty prefix, which no lock pins."""

    lock_ref = 0

    def __init__(self, device: torch.device) -> None:
        self.indices = torch.empty(0, dtype=torch.int64, device=device)

    def matched_indices(self) -> torch.Tensor:
        return self.indices


class ChunkCache(BasePrefixCache):
    """A match finds nothing and an insert keeps nothing, so the caller keeps, and at the
    end frees, every slot; with nothing held there is nothing to lock, evict or publish."""

    disable = True
    evicted_tokens = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.empty_handle = EmptyHandle(device)

    def match_prefix(self, key: RadixKey) -> MatchResult:
        return MatchResult(self.cached_slots(), self.empty_handle, 0)

    def insert(
        self,
        key: RadixKey,
        value: torch.Tensor,
        priority: int = 0,
        chunked: bool = False,
        swa_live_from: int = 0,
    ) -> InsertResult:
        return InsertResult(prefix_len=0, kept_len=0)

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, handle: CacheHandle) -> int:
        return 0

    def dec_lock_ref(self, handle: CacheHandle) -> int:
        return 0

    def evict_namespace(self, namespace: PrefixNamespace) -> int:
        return 0

    def dfs_weight_order(
        self, items: Sequence[T], handle: Callable[[T], CacheHandle | None]
    ) -> list[T]:
        """Every item matched the empty prefix: arrival order."""
        return list(items)

    def attach_kv_events(self, recorder: BlockEventRecorder) -> None:
        """Nothing is ever stored, so the start-up clear is all there is to record."""
        recorder.on_reset()

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def cached_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def reset(self) -> None:
        """Nothing is held."""

    def check_integrity(self) -> None:
        """Nothing is held, so nothing can disagree."""
