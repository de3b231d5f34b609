"""A hybrid model's K/V tensors: its full-attention layers over one pool of slots, its
sliding-window layers over a smaller one."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.mem.kv_pool import MHATokenToKVPool


class SWAKVPool:
    """SGLang's `SWAKVPool`: the interface of `MHATokenToKVPool` over two of them, the
    full-attention layers' (`size` slots) and the sliding layers' (`size_swa` slots).

    Callers always pass full slots; a sliding layer's are translated through
    `full_to_swa_index_mapping` (the allocator writes it, this pool only reads it). The
    attention backends read keys through slot tables, which they translate once per batch
    for the sliding layers (`slot_map`), never per layer.
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        swa_layers: Sequence[bool],
        full_to_swa_index_mapping: torch.Tensor,
        device: str | torch.device = "cpu",
    ):
        self.size = size
        self.size_swa = size_swa
        self.dtype = dtype
        self.device = torch.device(device)
        self.full_to_swa_index_mapping = full_to_swa_index_mapping
        self.swa_layers = tuple(swa_layers)
        num_swa = sum(self.swa_layers)
        shape = (dtype, head_num, head_dim)
        self.full_pool = MHATokenToKVPool(size, *shape, len(self.swa_layers) - num_swa, device)
        self.swa_pool = MHATokenToKVPool(size_swa, *shape, num_swa, device)
        counts = {False: 0, True: 0}
        self._layer_index: list[int] = []
        for is_swa in self.swa_layers:
            self._layer_index.append(counts[is_swa])
            counts[is_swa] += 1

    @staticmethod
    def split_tokens(
        total_tokens: int, swa_layers: Sequence[bool], ratio: float
    ) -> tuple[int, int]:
        """(full slots, SWA slots) in the bytes `total_tokens` slots of every layer take,
        with `ratio` SWA slots per full one (SGLang's `--swa-full-tokens-ratio` rule):
        full * num_full + ratio * full * num_swa = total_tokens * num_layers."""
        num_swa = sum(swa_layers)
        num_full = len(swa_layers) - num_swa
        full = int(total_tokens * len(swa_layers) / (num_full + ratio * num_swa))
        return full, max(1, int(full * ratio))

    def slot_map(self, layer_id: int) -> torch.Tensor | None:
        """What turns this layer's slots into rows of its buffers: the mapping for a
        sliding layer, None for a full one."""
        return self.full_to_swa_index_mapping if self.swa_layers[layer_id] else None

    def swa_slot_map(self) -> torch.Tensor | None:
        """What turns slots into the SWA pool's rows, every sliding layer's `slot_map`."""
        return self.full_to_swa_index_mapping

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.swa_pool if self.swa_layers[layer_id] else self.full_pool
        return pool.get_kv_buffer(self._layer_index[layer_id])

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None:
        """Write at full slots `loc`; a sliding layer writes at their SWA slots."""
        index = self._layer_index[layer_id]
        if self.swa_layers[layer_id]:
            swa_loc = self.full_to_swa_index_mapping.index_select(0, loc)
            self.swa_pool.set_kv_buffer(index, swa_loc, cache_k, cache_v)
        else:
            self.full_pool.set_kv_buffer(index, loc, cache_k, cache_v)


KVPool = MHATokenToKVPool | SWAKVPool
"""Either kind of pool: what a forward pass writes and reads K/V through."""
