"""Slots of a hybrid model's two KV pools: every token has a full-attention slot and,
while some query may still read it, a sliding-window slot."""

from __future__ import annotations

import torch

from engine.mem.allocator import TokenToKVPoolAllocator


class SWATokenToKVPoolAllocator(TokenToKVPoolAllocator):
    """SGLang's `SWATokenToKVPoolAllocator`: the full-attention layers' slots (this
    allocator's own free list, `size` of them) and the sliding layers' slots (`swa`,
    `size_swa` of them), tied by `full_to_swa_index_mapping`.

    Callers see full slots only: `alloc` hands out full slots and gives each an SWA slot
    through the mapping, `free` frees both, `free_swa` only the SWA part (the window has
    moved past it) and zeroes its entries, so 0 means "no SWA slot" (SWA slot 0 is the
    padding slot). The sliding layers translate through the mapping (`SWAKVPool`).
    """

    def __init__(self, size: int, size_swa: int, device: str | torch.device = "cpu") -> None:
        self.swa = TokenToKVPoolAllocator(size_swa, device)
        self.size_swa = size_swa
        self.full_to_swa_index_mapping = torch.zeros(size + 1, dtype=torch.int64, device=device)
        super().__init__(size, device)

    def available_size(self) -> int:
        """Tokens that can be allocated now: each needs a slot of both pools."""
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return super().available_size()

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > self.swa_available_size() or need_size > self.full_available_size():
            return None
        full = super().alloc(need_size)
        swa = self.swa.alloc(need_size)
        assert full is not None and swa is not None, "both pools were checked"
        self.full_to_swa_index_mapping[full] = swa
        return full

    def free(self, slots: torch.Tensor) -> None:
        """Free full slots and the SWA slots they still have."""
        if slots.numel():
            self.free_swa(slots)
            super().free(slots)

    def free_swa(self, slots: torch.Tensor) -> None:
        """Free the SWA slots of full slots whose window has passed; the full slots stay."""
        if slots.numel():
            slots = slots.to(self.device, torch.int64)
            swa = self.full_to_swa_index_mapping[slots]
            self.swa.free(swa[swa > 0])
            self.full_to_swa_index_mapping[slots] = 0

    def move_swa(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Give full slots `dst`, which have no SWA slot, the SWA slots of `src` (same
        tokens, so the same K/V), which are left with none: a cached prefix whose sliding
        KV was evicted takes a request's live copy instead of both being kept."""
        self.full_to_swa_index_mapping[dst] = self.full_to_swa_index_mapping[src]
        self.full_to_swa_index_mapping[src] = 0

    def swa_free_slots(self) -> torch.Tensor:
        """Every free SWA slot."""
        return self.swa.free_slots()

    def clear(self) -> None:
        super().clear()
        self.swa.clear()
        self.full_to_swa_index_mapping.zero_()
