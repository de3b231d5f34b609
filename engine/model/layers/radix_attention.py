"""An attention layer as the model sees it: q, k, v in, attention output out."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention.base import AttentionBackend, AttentionLayer, CpuDecodeInputs
from engine.model.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    """Hands one layer's q/k/v to the attention backend, which stores the new K/V in the
    pool and attends over each request's cached prefix. The model never touches the pool
    itself: a layer run as one CPU op gets the pool's buffers from the backend
    (`cpu_decode_inputs`)."""

    def __init__(self, layer: AttentionLayer, attn_backend: AttentionBackend):
        super().__init__()
        self.layer = layer
        self.attn_backend = attn_backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self.attn_backend.forward(q, k, v, self.layer, forward_batch)

    def cpu_decode_inputs(self, forward_batch: ForwardBatch) -> CpuDecodeInputs | None:
        """The backend's inputs for running this layer as one CPU op, where it allows that."""
        return self.attn_backend.cpu_decode_inputs(self.layer, forward_batch)
