"""Weights held quantized and multiplied as stored (`--quantization`, vLLM's flag).

- `gguf`: a GGUF file's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K tensors stay in
  the file's blocks, 4.5-8.5 bits a weight (a bf16 copy is 16); the embedded model's Q4_1
  layers and Q8_0 embedding are served this way by default, and a Q4_K_M file's tensors
  (Q4_K and Q6_K, with Q5_0 where a row is not a whole number of 256-weight super-blocks,
  as in Gemma 3 270M's 640-wide rows); a fused layer whose parts differ in format (Gemma 3
  270M's Q5_0 q and k beside a Q8_0 v) keeps each part's blocks. The Q5 formats are the
  Q4 ones with a fifth bit per weight, and share their kernels. Other GGUF types (Q2_K,
  Q3_K, f16, ...) are dequantized at load.
- `int8`: float checkpoints quantized at load to int8 rows, one float scale per output row
  (`w ~ s * q`, `s = max|w| / 127`).

A quantized module holds `weight` as uint8 rows of `row_bytes(format, K)` bytes and its
`quant_format`; `cpu_ops.quant_linear` widens the blocks in registers for decode rows
and per band for a prefill's GEMM (csrc/quant_linear.cpp, which documents the layouts).
On CUDA the GGUF blocks are decoded in registers per tile of a Triton matmul
(engine/kernels/triton/gguf_matmul.py); int8 rows are CPU only. One rank: a
tensor-parallel shard of a row-parallel layer would split blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum

import gguf
import torch
from torch import nn

from engine.model.layers.embedding import VocabParallelEmbedding
from engine.model.layers.linear import BlockPart, Linear, MergedColumnParallelLinear

BLOCK = 32


class WeightFormat(IntEnum):
    """The kernel's format ids: GGML's type ids for the block formats."""

    Q4_0 = int(gguf.GGMLQuantizationType.Q4_0)
    Q4_1 = int(gguf.GGMLQuantizationType.Q4_1)
    Q5_0 = int(gguf.GGMLQuantizationType.Q5_0)
    Q5_1 = int(gguf.GGMLQuantizationType.Q5_1)
    Q8_0 = int(gguf.GGMLQuantizationType.Q8_0)
    Q4_K = int(gguf.GGMLQuantizationType.Q4_K)
    Q5_K = int(gguf.GGMLQuantizationType.Q5_K)
    Q6_K = int(gguf.GGMLQuantizationType.Q6_K)
    INT8 = 1000


BLOCK_LAYOUTS = {
    WeightFormat.Q4_0: (32, 18),
    WeightFormat.Q4_1: (32, 20),
    WeightFormat.Q5_0: (32, 22),
    WeightFormat.Q5_1: (32, 24),
    WeightFormat.Q8_0: (32, 34),
    WeightFormat.Q4_K: (256, 144),
    WeightFormat.Q5_K: (256, 176),
    WeightFormat.Q6_K: (256, 210),
}
"""(weights, bytes) of one block of each GGUF format the kernels serve."""


def gguf_format(tensor_type: gguf.GGMLQuantizationType) -> WeightFormat | None:
    """The format a GGUF tensor of this type is served in, None if it is dequantized."""
    try:
        format = WeightFormat(int(tensor_type))
    except ValueError:
        return None
    return format if format in BLOCK_LAYOUTS else None


def row_bytes(format: WeightFormat, in_features: int) -> int:
    """Bytes of one output row of `in_features` weights (a multiple of the block's)."""
    if format is WeightFormat.INT8:
        return in_features + 4  # the row's float32 scale after its int8 weights
    weights, size = BLOCK_LAYOUTS[format]
    return in_features // weights * size


def quantize_int8_rows(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` float weights as int8 rows with their float32 scales (`WeightFormat.INT8`)."""
    w = weight.detach().to(torch.float32)
    scale = (
        w.abs().amax(dim=1, keepdim=True).div_(127.0).clamp_(min=torch.finfo(torch.float32).tiny)
    )
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1).contiguous()


def hold_blocks(
    module: Linear | VocabParallelEmbedding, format: WeightFormat, activation_bits: int
) -> None:
    """Make `module.weight` (`[N, K]`, not loaded yet) uint8 rows of `format`, keeping its
    weight loader: the checkpoint's blocks are then copied in row by row. Decode rows are
    rounded to `activation_bits` per block of 32 first (`--quantized-activations`; 32:
    kept float)."""
    rows, in_features = module.weight.shape
    _hold_bytes(module, (rows, row_bytes(format, in_features)))
    module.quant_format = format
    module.activation_bits = activation_bits


def hold_part_blocks(
    module: MergedColumnParallelLinear,
    formats: Mapping[str | None, WeightFormat],
    activation_bits: int,
) -> None:
    """`hold_blocks` for a fused layer whose parts (`formats`, by shard id) come in different
    formats: each run of consecutive parts of one format becomes a `BlockPart` (one matmul),
    its rows a view of `weight`, now all the parts' bytes one after another."""
    runs: list[tuple[WeightFormat, int, int]] = []  # (format, first row, rows)
    for shard_id, rows in module.output_sizes.items():
        format = formats[shard_id]
        if runs and runs[-1][0] == format:
            runs[-1] = (format, runs[-1][1], runs[-1][2] + rows)
        else:
            runs.append((format, module.shard_offsets[shard_id], rows))
    sizes = [rows * row_bytes(format, module.input_size) for format, _, rows in runs]
    flat = _hold_bytes(module, (sum(sizes),))
    module.block_parts = tuple(
        BlockPart(start, part.view(rows, -1), format)
        for (format, start, rows), part in zip(runs, flat.split(sizes))
    )
    module.activation_bits = activation_bits


def _hold_bytes(module: Linear | VocabParallelEmbedding, shape: tuple[int, ...]) -> torch.Tensor:
    """Replace `module.weight` by uint8 bytes of `shape`, keeping its weight loader."""
    old = module.weight
    new = nn.Parameter(
        torch.empty(shape, dtype=torch.uint8, device=old.device), requires_grad=False
    )
    if hasattr(old, "weight_loader"):
        vars(new)["weight_loader"] = old.weight_loader
    module.weight = new
    return new.data


def quantize_module_int8(module: Linear, activation_bits: int) -> None:
    """Replace a loaded float `module.weight` by its int8 rows."""
    module.weight = nn.Parameter(quantize_int8_rows(module.weight), requires_grad=False)
    module.quant_format = WeightFormat.INT8
    module.activation_bits = activation_bits


def weights_format(model: nn.Module, dtype: torch.dtype) -> str:
    """How the model's matmul weights are held, as `/get_server_info` shows it: the dtype's
    name, or the quantized formats (`gguf:Q4_1,Q8_0`; plus the dtype where some layers kept
    it)."""
    held: set[int | None] = set()
    for module in model.modules():
        if isinstance(module, Linear) and module.block_parts:
            held.update(part.format for part in module.block_parts)
        elif isinstance(module, (Linear, VocabParallelEmbedding)):
            held.add(module.quant_format)
    formats = sorted(WeightFormat(f) for f in held if f is not None)
    dtype_name = str(dtype).removeprefix("torch.")
    if not formats:
        return dtype_name
    names = [f.name for f in formats if f is not WeightFormat.INT8]
    parts = (["gguf:" + ",".join(names)] if names else []) + (
        ["int8"] if WeightFormat.INT8 in formats else []
    )
    if None in held:
        parts.append(dtype_name)
    return "+".join(parts)
