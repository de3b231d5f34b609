"""Token-sequence keys of the radix tree and their longest-common-prefix match."""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from typing import NamedTuple, overload

import torch

from engine.cache.namespace import PrefixNamespace


class PrefixMatch(NamedTuple):
    length: int
    comparisons: int


def common_prefix_len(a: memoryview, b: memoryview) -> PrefixMatch:
    """Longest common prefix of two int64 memoryviews by galloping, then binary search.

    Each probe compares a window of slices in C (`a[lo:hi] == b[lo:hi]`), never one
    Python-level token at a time: windows of 1, 2, 4, ... tokens until one differs,
    then bisection inside that window. A 10,000-token shared prefix costs 27 slice
    comparisons instead of 10,001 token comparisons.
    """
    n = min(len(a), len(b))
    lo, step, comparisons = 0, 1, 0
    while lo < n:
        hi = lo + step
        comparisons += 1
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, step * 2
    else:
        return PrefixMatch(n, comparisons)
    # Invariant: a[:lo] == b[:lo] and the first difference lies in [lo, hi).
    while hi - lo > 1:
        mid = (lo + hi) // 2
        comparisons += 1
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return PrefixMatch(lo, comparisons)


def _as_memoryview(token_ids: Sequence[int] | torch.Tensor | memoryview) -> memoryview:
    if isinstance(token_ids, memoryview):
        if token_ids.format != "q":
            raise TypeError(f"RadixKey memoryviews must have format 'q', got {token_ids.format!r}")
        return token_ids
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    return memoryview(array("q", token_ids))


class RadixKey:
    """Token ids plus their `extra_key` namespace (`PrefixNamespace`; None is the default).

    Keys in different namespaces share nothing: they never match and never share nodes.
    Slicing is zero-copy (a memoryview over the same buffer).
    """

    __slots__ = ("token_ids", "extra_key")

    def __init__(
        self,
        token_ids: Sequence[int] | torch.Tensor | memoryview,
        extra_key: PrefixNamespace | None = None,
    ):
        self.token_ids: memoryview = _as_memoryview(token_ids)
        self.extra_key = extra_key

    def __len__(self) -> int:
        return len(self.token_ids)

    @overload
    def __getitem__(self, idx: int) -> int: ...
    @overload
    def __getitem__(self, idx: slice) -> RadixKey: ...
    def __getitem__(self, idx: int | slice) -> int | RadixKey:
        if isinstance(idx, slice):
            return RadixKey(self.token_ids[idx], self.extra_key)
        return self.token_ids[idx]

    def child_key(self) -> Hashable:
        """Key under which a node starting with this key hangs from its parent."""
        return (self.extra_key, self.token_ids[0])

    def match(self, other: RadixKey) -> int:
        """Length of the common prefix; 0 across namespaces."""
        if self.extra_key != other.extra_key:
            return 0
        return common_prefix_len(self.token_ids, other.token_ids).length

    def tolist(self) -> list[int]:
        return self.token_ids.tolist()

    def __repr__(self) -> str:
        head = self.token_ids[:8].tolist()
        more = "..." if len(self) > 8 else ""
        return f"RadixKey({head}{more}, extra_key={self.extra_key!r})"
