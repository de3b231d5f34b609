"""The physical K/V tensors that slots index into."""

from __future__ import annotations

import torch


class MHATokenToKVPool:
    """Per-layer K and V buffers of shape `[size + 1, kv_heads, head_dim]`.

    Row 0 of every buffer belongs to the padding slot. The pool only stores and returns
    tensors; which slot belongs to whom is the allocator's and the radix cache's business.
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device = "cpu",
    ):
        self.size = size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        shape = (size + 1, head_num, head_dim)
        self.k_buffer = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layer_num)
        ]
        self.v_buffer = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layer_num)
        ]

    @staticmethod
    def cell_size(head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        return 2 * layer_num * head_num * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def max_tokens_for_budget(
        cls, budget_bytes: int, head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype
    ) -> int:
        """How many token slots fit in `budget_bytes` (the padding slot included)."""
        return budget_bytes // cls.cell_size(head_num, head_dim, layer_num, dtype) - 1

    def slot_map(self, layer_id: int) -> torch.Tensor | None:
        """None: every layer's rows are its slots (`SWAKVPool` maps its sliding layers')."""
        return None

    def swa_slot_map(self) -> torch.Tensor | None:
        """None: no layer's rows are a pool of their own (`SWAKVPool`'s sliding layers' are)."""
        return None

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None:
        """Write the K/V of the tokens at slots `loc` (`[n]` int64) from `[n, kv_heads, head_dim]`
        tensors. `index_copy_` rather than `buffer[loc] = …`: on CPU index_put costs about twice
        as much per call, and this runs twice per layer per step."""
        self.k_buffer[layer_id].index_copy_(0, loc, cache_k.to(self.dtype))
        self.v_buffer[layer_id].index_copy_(0, loc, cache_v.to(self.dtype))
