"""The prefix cache's interface: KV slots stored under token runs (`RadixKey`s).

The cache knows keys and slots only. Which request holds which slots, and when they are
inserted, matched or freed, is the business of the scheduler's `CacheManager`, which keeps
a match's `CacheHandle` and hands it back to lock the prefix without knowing what it is.
Two implementations: `RadixCache` shares prefixes across requests (its handles are tree
nodes); `ChunkCache` (`--disable-radix-cache`) shares nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol, TypeVar

import torch

from engine.cache.namespace import PrefixNamespace
from engine.cache.radix_key import RadixKey

if TYPE_CHECKING:
    from engine.cache.kv_events import BlockEventRecorder

T = TypeVar("T")


class CacheHandle(Protocol):
    """A matched prefix as the cache that matched it knows it (mini-sglang's
    `BaseCacheHandle`). The caller keeps it with the request, hands it back to lock, unlock
    and order by, and reads no more of it than this: each cache has its own kind."""

    @property
    def lock_ref(self) -> int:
        """How many running requests lock the prefix."""

    def matched_indices(self) -> torch.Tensor:
        """The prefix's KV slots, in token order."""


class MatchResult(NamedTuple):
    device_indices: torch.Tensor
    """KV slots of the longest cached prefix (int64, possibly empty)."""
    last_node: CacheHandle
    """The handle of the match: lock it to pin the prefix."""
    full_match_len: int
    """Tokens whose full-attention KV the cache held: a hybrid model's tree cuts its match
    back from them to where the window before its end is live; elsewhere, the match."""


class InsertResult(NamedTuple):
    prefix_len: int
    """Leading tokens the cache held before: the caller's slots for them are duplicates,
    which the caller frees."""
    kept_len: int
    """Leading tokens the cache holds after the insert; the caller's slots beyond them stay
    the caller's (to free once its request finishes)."""


def check_invariant(ok: bool, message: str) -> None:
    """Raise AssertionError(message) unless `ok`: an assert that `python -O` keeps."""
    if not ok:
        raise AssertionError(message)


class BasePrefixCache(ABC):
    """KV slots under token keys, with SGLang's surface: match, insert, lock, evict.

    Slots the cache holds are either evictable (no lock on them: `evict` may free them to
    the allocator on demand) or protected (locked by a running request's prefix).
    """

    disable: ClassVar[bool]
    """True for a cache that never shares a prefix: cache-aware orders have nothing to go by."""
    evicted_tokens: int
    """Tokens evicted since creation; a counter, so `reset` leaves it alone."""

    @abstractmethod
    def match_prefix(self, key: RadixKey) -> MatchResult:
        """The longest cached prefix of `key`, within its namespace."""

    @abstractmethod
    def insert(
        self,
        key: RadixKey,
        value: torch.Tensor,
        priority: int = 0,
        chunked: bool = False,
        swa_live_from: int = 0,
    ) -> InsertResult:
        """Offer `key` with its KV slots `value`. `chunked` marks a chunked-prefill
        self-insert, which does not count as a hit. `swa_live_from`: a hybrid model's
        tokens before it have no sliding-window KV left in `value` (a cache that knows no
        windows is never given such tokens)."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked slots, if held; return how many were freed."""

    @abstractmethod
    def inc_lock_ref(self, handle: CacheHandle) -> int:
        """Lock the prefix `handle` matched; return the change in evictable size (≤ 0)."""

    @abstractmethod
    def dec_lock_ref(self, handle: CacheHandle) -> int:
        """Unlock the prefix `handle` matched; return the change in evictable size (≥ 0)."""

    @abstractmethod
    def evict_namespace(self, namespace: PrefixNamespace) -> int:
        """Free every unlocked prefix of `namespace` (an unloaded LoRA adapter's); return
        the slots freed."""

    @abstractmethod
    def dfs_weight_order(
        self, items: Sequence[T], handle: Callable[[T], CacheHandle | None]
    ) -> list[T]:
        """`items` in a depth-first walk of the prefixes their handles matched (no handle:
        the empty prefix), heavier subtrees first, where an item weighs on its prefix and
        every shorter one; items sharing a prefix thus run together (the SGLang paper's
        DFS-weight order)."""

    @abstractmethod
    def attach_kv_events(self, recorder: BlockEventRecorder) -> None:
        """Record the cache as KV-cache events from now on, starting with the clear of
        start-up; the cache must be empty."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Slots held and unlocked: free on demand, so admission budgets them as free."""

    @abstractmethod
    def protected_size(self) -> int:
        """Slots held and locked by running requests."""

    def swa_evictable_size(self) -> int:
        """A hybrid model's SWA slots held and unlocked; none in a cache without windows."""
        return 0

    def swa_protected_size(self) -> int:
        """A hybrid model's SWA slots held and locked; none in a cache without windows."""
        return 0

    def evict_swa(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked SWA slots, if held, keeping their tokens'
        full KV; return how many were freed. A cache without windows holds none apart."""
        return 0

    @abstractmethod
    def cached_slots(self) -> torch.Tensor:
        """Every slot the cache holds, for the slot accounting of integrity checks."""

    def cached_swa_slots(self) -> torch.Tensor:
        """The (full) slots whose sliding-window KV the cache holds: a cache without
        windows holds every layer's KV of each token it keeps."""
        return self.cached_slots()

    @abstractmethod
    def reset(self) -> None:
        """Drop everything held. Slots are not freed: pair with the allocator's `clear()`."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError unless the cache's structure and size ledgers agree."""
