"""Linear layers whose weights arrive from checkpoints in pieces.

Each parameter carries a `weight_loader(param, loaded, shard_id)`; the model's
`load_weights` routes every checkpoint tensor to it. Parameters are allocated with
`torch.empty`: every one is overwritten by the checkpoint, so initialising them is wasted time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
    """Copy a whole checkpoint tensor into `param` (converting dtype and device)."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """`y = x W^T + b` with weights loaded whole."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnLinear(Linear):
    """Several projections of the same input in one matmul (gate_up, qkv): the checkpoint's
    separate tensors, named by `shard_id`, are copied into consecutive row blocks."""

    def __init__(self, input_size: int, output_sizes: dict[str, int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes.values()), bias)
        self.output_sizes = output_sizes
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for shard_id, size in output_sizes.items():
            self.shard_offsets[shard_id] = offset
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:
            raise ValueError(f"a merged linear layer loads one of {list(self.output_sizes)} at a time")
        offset, size = self.shard_offsets[shard_id], self.output_sizes[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded)


class QKVLinear(MergedColumnLinear):
    """The q, k and v projections fused; `forward` output splits as `[q_size, kv_size, kv_size]`."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias)
