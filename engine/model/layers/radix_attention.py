"""An attention layer as the model sees it: q, k, v in, attention output out."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention.base import AttentionBackend, AttentionLayer
from engine.model.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    """Hands one layer's q/k/v to the attention backend, which stores the new K/V in the
    pool and attends over each request's cached prefix. The model never touches the pool."""

    def __init__(self, layer: AttentionLayer, attn_backend: AttentionBackend):
        super().__init__()
        self.layer = layer
        self.attn_backend = attn_backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self.attn_backend.forward(q, k, v, self.layer, forward_batch)
