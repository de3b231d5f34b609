"""Linear layers whose weights arrive from checkpoints in pieces.

Each parameter carries a `weight_loader(param, loaded, shard_id)` (`set_weight_loader`);
the model's `load_weights` routes every checkpoint tensor to it (`get_weight_loader`).
Parameters are allocated with `torch.empty`: every one is overwritten by the checkpoint, so
initialising them is wasted time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(
    param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None
) -> None:
    """Copy a whole checkpoint tensor into `param` (converting dtype and device)."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
            f"{tuple(param.shape)}"
        )
    param.data.copy_(loaded)


WeightLoader = Callable[[nn.Parameter, torch.Tensor, str | None], None]
"""Copies one checkpoint tensor (or the shard `shard_id` of a fused one) into a parameter."""


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    """Attach `loader` to `param`, where `load_weights` finds it (SGLang's attribute name)."""
    vars(param)["weight_loader"] = loader


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    """The loader attached to `param`, else a whole-tensor copy."""
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


PACK_BATCH_HINT = 32
"""The row count oneDNN picks its blocked weight layout for; any row count still works."""


def mkldnn_packing_applies(weight: torch.Tensor) -> bool:
    """bf16 weights on a CPU whose oneDNN has bf16 kernels (avx512_bf16 or AMX)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered once into oneDNN's blocked layout, where that applies (else None):
    F.linear reorders a plain bf16 weight on every call, which costs 1.1-2.4x per matmul on
    CPU, decode rows most."""
    if not mkldnn_packing_applies(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear, through the packed copy of `weight` when there is one."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """`y = x W^T + b` with weights loaded whole."""

    packed_weight: torch.Tensor | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        default_weight_loader(param, loaded)

    def pack_weight(self) -> None:
        """Once the weights are loaded. The plain `weight` stays, for loading and inspection."""
        self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed_weight, self.bias)


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

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        if shard_id is None:
            raise ValueError(
                f"a merged linear layer loads one of {list(self.output_sizes)} at a time"
            )
        offset, size = self.shard_offsets[shard_id], self.output_sizes[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded)


class QKVLinear(MergedColumnLinear):
    """The q, k and v projections fused; `forward` output splits as
    `[q_size, kv_size, kv_size]`."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ):
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(
            hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias
        )
