"""The seam between a model's attention layers and the kernels that run them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.model.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayer:
    """Static shape of one attention layer, as a backend needs it."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None
    """A query at position p sees only the keys at (p - sliding_window, p], the last
    `sliding_window` positions including its own (as transformers and llama.cpp count it);
    None: every earlier position. Per layer: Gemma 3 mixes windowed and global layers.
    Backends never read the keys before a query's window, so their KV may be freed."""

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")


class CpuDecodeInputs(NamedTuple):
    """What a layer run as one C++ op (`cpu_ops.decode_layer`) needs to write its new K/V
    and attend: the layer's pool buffers, the new tokens' slots, and each request's slots and
    length as the CPU decode kernel reads them (with `slot_index`, the row of `slots` each
    token reads: a prefill's tokens under `batch_invariant`)."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    out_cache_loc: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    slot_index: torch.Tensor | None = None
    batch_invariant: bool = False
    window: int = 0
    """The layer's sliding window as the kernels take it (0: none)."""


class AttentionBackend(ABC):
    """Computes causal attention for a ForwardBatch over the paged KV pool.

    `forward` first writes the new tokens' K/V into the pool at `out_cache_loc`, then lets
    each token attend to its request's prefix (read through `req_to_token`) and to the new
    tokens before it. `q` is `[num_tokens, num_heads, head_dim]`, `k`/`v` are
    `[num_tokens, num_kv_heads, head_dim]`; the result is `[num_tokens, num_heads, head_dim]`.
    Every backend is built with the same keyword arguments, so the runner never branches on
    which one it got.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, device: str | torch.device
    ):
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build per-batch index tensors once, before the first layer runs."""

    @abstractmethod
    def init_cuda_graph_state(
        self, max_bs: int, max_context_len: int, static_shapes: bool = True
    ) -> None:
        """Allocate what captured decode batches of up to `max_bs` requests share, before
        any capture (SGLang's name; the GraphRunner calls it on every device).
        `static_shapes` False: the graph is compiled by `torch.compile`, whose opaque ops
        may read host values and size their work by them, rather than recorded."""

    @abstractmethod
    def init_forward_metadata_graph(self, forward_batch: ForwardBatch) -> None:
        """`init_forward_metadata` for a decode batch inside a captured graph, replayed at
        every step: device ops with static shapes only (no host values, no `*_cpu` lists, no
        data-dependent sizes), writing into the buffers of `init_cuda_graph_state`.
        Computing the metadata inside the graph leaves replay no host-side pass to make."""

    def cpu_decode_inputs(
        self, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> CpuDecodeInputs | None:
        """For a batch whose every request decodes, where this backend would attend with the
        CPU decode kernel: what lets the model run the layer as one op (under
        --enable-deterministic-inference, for every batch). None otherwise."""
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        forward_batch.token_to_kv_pool.set_kv_buffer(
            layer.layer_id, forward_batch.out_cache_loc, k, v
        )
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, layer, forward_batch)
        return self.forward_extend(q, layer, forward_batch)

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor: ...
