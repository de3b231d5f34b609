"""Linear layers whose weights arrive from checkpoints in pieces, split across the ranks of
the tensor-parallel group (Megatron's layout, SGLang's names).

Each parameter carries a `weight_loader(param, loaded, shard_id)` (`set_weight_loader`);
the model's `load_weights` routes every checkpoint tensor to it (`get_weight_loader`). A
loader copies only this rank's slice, read with `narrow` from a `CheckpointTensor`, which may
be a lazy view of a file that reads just that slice. Parameters are allocated with
`torch.empty`: every one is overwritten by the checkpoint, so initialising them is wasted
time.

A column-parallel layer (qkv, gate_up) holds 1/N of the output rows and needs no
communication; a row-parallel one (o_proj, down_proj) holds 1/N of the input columns, so its
partial products are summed by exactly one all-reduce. At TP=1 the group is a group of one
and these are plain linear layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_tp_group
from engine.kernels import custom_op
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.custom_op import cpu_kernels_on


class CheckpointTensor(Protocol):
    """A checkpoint tensor as the loaders see it: a `torch.Tensor`, or a lazy view of a file
    whose `narrow` reads only the slice asked for."""

    @property
    def shape(self) -> torch.Size: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


def copy_shard(
    target: torch.Tensor,
    loaded: CheckpointTensor,
    dim: int = 0,
    start: int = 0,
    full_len: int | None = None,
) -> int:
    """Copy `loaded[start : start + len]` along `dim` into `target` (`len` being target's
    length there), where `loaded` is `full_len` long along `dim` (default: as target) and
    as target along every other dim. Returns the elements written."""
    expected = list(target.shape)
    if full_len is not None:
        expected[dim] = full_len
    if list(loaded.shape) != expected:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
            f"{tuple(expected)}"
        )
    target.copy_(loaded.narrow(dim, start, target.shape[dim]))
    return target.numel()


def default_weight_loader(
    param: torch.Tensor, loaded: CheckpointTensor, shard_id: str | None = None
) -> int:
    """Copy a whole checkpoint tensor into `param` (converting dtype and device): the
    parameters every rank holds in full."""
    return copy_shard(param.data, loaded)


class LoRAHook(Protocol):
    """Adds a LoRA term to a layer's output (engine/lora/layers.py's `LoRALayer`)."""

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


WeightLoader = Callable[[nn.Parameter, CheckpointTensor, str | None], int]
"""Copies this rank's part of one checkpoint tensor (or of the shard `shard_id` of a fused
one) into a parameter; returns how many of the parameter's elements it filled."""


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
    """`weight` reordered once for the CPU's bf16 matmul, where that applies (else None): for
    the AMX kernel (`cpu_ops.amx_pack`) where the CPU has AMX, else into oneDNN's
    blocked layout. F.linear reorders a plain bf16 weight on every call, a cost paid again by
    every matmul and felt most by decode rows (docs/benchmarks/serving.md, "The decode work
    behind these figures")."""
    amx = cpu_ops.amx_pack(weight)
    if amx is not None or not mkldnn_packing_applies(weight):
        return amx
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    quant_format: int | None = None,
    activation_bits: int = 32,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """F.linear through the CPU's faster kernels where they apply: over a quantized weight
    (`quant_format`, engine/model/layers/quantization.py) `cpu_ops.quant_linear`, on CUDA
    the Triton `gguf_linear` (float activations: `activation_bits` is the CPU's); for
    the few rows of a small bf16 decode batch `cpu_ops.linear_few_rows`, else the packed
    copy of `weight` (AMX or oneDNN). Under `torch.compile`, torch's own matmul.

    `batch_invariant` (--enable-deterministic-inference): kernels that sum each row in one
    order whatever the number of rows, float activations over quantized weights; each of
    the others changes its order, or its rounding of `x`, with the row count."""
    if batch_invariant:
        rows = x.reshape(-1, x.shape[-1])
        if quant_format is None:
            out = cpu_ops.linear_rows(rows, weight, bias)
        else:
            out = cpu_ops.quant_linear(rows, weight, quant_format, bias, 32, True)
        return out.view(*x.shape[:-1], out.shape[-1])
    if quant_format is not None:
        if custom_op.uses_triton(x):
            from engine.kernels.triton.gguf_matmul import gguf_linear  # imports Triton

            return gguf_linear(x, weight, quant_format, bias)
        rows = x.reshape(-1, x.shape[-1])
        out = cpu_ops.quant_linear(rows, weight, quant_format, bias, activation_bits)
        return out.view(*x.shape[:-1], out.shape[-1])
    kernels = cpu_kernels_on(x)
    if (
        kernels
        and bias is None
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and x.shape[0] <= cpu_ops.FEW_ROWS
    ):
        return cpu_ops.linear_few_rows(x, weight)
    if packed is not None and cpu_ops.is_amx_packed(packed):
        if not kernels:
            return F.linear(x, weight, bias)
        if x.dim() == 2:  # a layer's hidden states: no reshape to dispatch
            return cpu_ops.linear_amx(x, packed, weight.shape[0], bias)
        out = cpu_ops.linear_amx(x.reshape(-1, x.shape[-1]), packed, weight.shape[0], bias)
        return out.view(*x.shape[:-1], out.shape[-1])
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class BlockPart(NamedTuple):
    """Consecutive output rows of a fused layer, from row `start`, held in one block format:
    `weight` their uint8 rows (a view of the layer's flat `weight`)."""

    start: int
    weight: torch.Tensor
    format: int


class Linear(nn.Module):
    """`y = x W^T + b` with this rank's weights: whole (replicated) here; the parallel
    layers below hold a slice. Packing (`pack_weight`) applies to whatever slice is held."""

    packed_weight: torch.Tensor | None = None
    quant_format: int | None = None
    """Set when `weight` holds quantized rows (`quantization.hold_blocks`)."""
    block_parts: tuple[BlockPart, ...] = ()
    """Set instead on a fused layer whose parts a checkpoint stores in different block
    formats (`quantization.hold_part_blocks`): `weight` is then their bytes, flat."""
    activation_bits = 32
    batch_invariant = False
    """Set by --enable-deterministic-inference (`engine/model/batch_invariant.py`)."""
    lora: LoRAHook | None = None
    """Set on the layers adapters target when LoRA is on (engine/lora)."""

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
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: str | None = None
    ) -> int:
        return default_weight_loader(param, loaded)

    def pack_weight(self) -> None:
        """Once the weights are loaded. The plain `weight` stays, for loading and inspection."""
        if self.quant_format is None and not self.block_parts:
            self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_lora(x, self.matmul(x, self.bias))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x W^T + bias` through `linear`; over block parts, each part's output side by side."""
        bits, invariant = self.activation_bits, self.batch_invariant
        if self.block_parts:
            outputs = []
            for part in self.block_parts:
                rows = part.weight.shape[0]
                part_bias = None if bias is None else bias.narrow(0, part.start, rows)
                out = linear(x, part.weight, None, part_bias, part.format, bits, invariant)
                outputs.append(out)
            return torch.cat(outputs, dim=-1)
        return linear(x, self.weight, self.packed_weight, bias, self.quant_format, bits, invariant)

    def with_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` plus the LoRA term of `x`, when adapters target this layer."""
        return y if self.lora is None else self.lora(x, y)


class Shard(NamedTuple):
    """Which slice of a checkpoint tensor, `full_size` long along the split dim (rows of a
    column-parallel layer, columns of a row-parallel one), this rank holds."""

    full_size: int
    start: int
    size: int


def even_shard(full_size: int) -> Shard:
    """This rank's 1/N of `full_size` (`ModelConfig.verify_tp_size` checked that N divides
    it)."""
    group = get_tp_group()
    size = full_size // group.size
    return Shard(full_size, group.rank * size, size)


class MergedColumnParallelLinear(Linear):
    """Several projections of the same input in one matmul (gate_up, qkv), each split by
    output rows across the ranks: the checkpoint's separate tensors, named by `shard_id`,
    are narrowed to this rank's rows and copied into consecutive row blocks."""

    def __init__(self, input_size: int, output_sizes: dict[str, int], bias: bool = False):
        self.shards = {
            shard_id: self.row_shard(shard_id, size) for shard_id, size in output_sizes.items()
        }
        super().__init__(input_size, sum(shard.size for shard in self.shards.values()), bias)
        self.output_sizes = {shard_id: shard.size for shard_id, shard in self.shards.items()}
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for shard_id, shard in self.shards.items():
            self.shard_offsets[shard_id] = offset
            offset += shard.size

    def row_shard(self, shard_id: str, full_size: int) -> Shard:
        """The rows of checkpoint tensor `shard_id` that this rank holds."""
        return even_shard(full_size)

    def weight_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: str | None = None
    ) -> int:
        if shard_id is None:
            raise ValueError(f"a merged linear layer loads one of {list(self.shards)} at a time")
        shard, offset = self.shards[shard_id], self.shard_offsets[shard_id]
        if param is self.weight and self.block_parts:  # in the part that holds its rows
            part = next(p for p in reversed(self.block_parts) if p.start <= offset)
            target = part.weight.narrow(0, offset - part.start, shard.size)
        else:
            target = param.data.narrow(0, offset, shard.size)
        return copy_shard(target, loaded, 0, shard.start, shard.full_size)


class QKVParallelLinear(MergedColumnParallelLinear):
    """The q, k and v projections fused, with this rank's heads: `forward` output splits as
    `[q_size, kv_size, kv_size]`, per rank. q heads are split evenly; KV heads too, or, when
    the ranks outnumber them, each rank holds the one KV head its q heads attend with."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ):
        group = get_tp_group()
        kv_replicas = max(1, group.size // num_kv_heads)
        self.kv_shard_rank = group.rank // kv_replicas
        self.q_size = num_heads // group.size * head_dim
        self.kv_size = max(1, num_kv_heads // group.size) * head_dim
        full_kv = num_kv_heads * head_dim
        super().__init__(hidden_size, {"q": num_heads * head_dim, "k": full_kv, "v": full_kv}, bias)

    def row_shard(self, shard_id: str, full_size: int) -> Shard:
        if shard_id == "q":
            return even_shard(full_size)
        return Shard(full_size, self.kv_shard_rank * self.kv_size, self.kv_size)


class RowParallelLinear(Linear):
    """Input columns split across the ranks (o_proj, down_proj, after a column-parallel
    layer): each rank's partial product is summed by one all-reduce. Rank 0 alone adds the
    bias, before the sum, so it is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        group = get_tp_group()
        self.tp_rank = group.rank
        self.input_shard = even_shard(input_size)
        super().__init__(self.input_shard.size, output_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: str | None = None
    ) -> int:
        if param is self.bias or self.quant_format is not None:  # quantized: one rank
            return default_weight_loader(param, loaded)
        shard = self.input_shard
        return copy_shard(param.data, loaded, 1, shard.start, shard.full_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        partial = self.with_lora(x, self.matmul(x, bias))
        return get_tp_group().all_reduce(partial)
