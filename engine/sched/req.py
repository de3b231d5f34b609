"""A generation request as the scheduler and the radix cache see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.cache.radix_cache import TreeNode


@dataclass(eq=False)
class Req:
    """Token state and KV ownership of one request.

    KV ownership of the request's `req_to_token` row:
    - `[0, len(prefix_indices))`: slots owned by the radix tree, pinned by `last_node`'s lock;
    - `[len(prefix_indices), kv_allocated_len)`: slots the request owns and must free.
    `kv_committed_len` counts the leading tokens whose K/V has actually been written.
    """

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    extra_key: str | None = None
    priority: int = 0
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: TreeNode | None = None
    kv_allocated_len: int = 0
    kv_committed_len: int = 0

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def all_token_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids
