"""Second level of the page table: which KV slots are free."""

from __future__ import annotations

import torch


class TokenToKVPoolAllocator:
    """Hands out KV slots one token at a time (`constants.PAGE_SIZE`).

    Free slots start as `arange(1, size + 1)`: slot 0 is the padding slot that padded
    tokens write their garbage K/V into. The free list lives on the pool's device, so
    `alloc` and `free` never synchronise with it. Freed slots are parked in a list and
    merged into the free list only when an allocation needs them, so freeing costs no
    copy of the whole pool; allocations are copies, so that callers holding slots (tree
    nodes, for hours) never pin an old free-list buffer in memory.
    """

    _free: torch.Tensor
    _released: list[torch.Tensor]
    _released_size: int

    def __init__(self, size: int, device: str | torch.device = "cpu") -> None:
        if size < 1:
            raise ValueError(f"TokenToKVPoolAllocator needs size >= 1, got {size}")
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def available_size(self) -> int:
        return len(self._free) + self._released_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Return `need_size` free slots (int64), or None when fewer are free."""
        if need_size > len(self._free):
            self._merge_released()
            if need_size > len(self._free):
                return None
        slots = self._free[:need_size].clone()
        self._free = self._free[need_size:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._released.append(slots.to(self.device, torch.int64))
            self._released_size += slots.numel()

    def free_slots(self) -> torch.Tensor:
        """Every free slot, in the order they will be handed out."""
        self._merge_released()
        return self._free

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._released = []
        self._released_size = 0

    def _merge_released(self) -> None:
        if self._released:
            self._free = torch.cat([self._free, *self._released])
            self._released, self._released_size = [], 0
