"""Linear layers with oneDNN-packed weights give what F.linear gives, to bf16 rounding (a
fused bias is added before the one rounding, not after)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers.linear import (
    Linear,
    QKVParallelLinear,
    mkldnn_packing_applies,
    pack_weight,
)

PACKS = mkldnn_packing_applies(torch.empty(1, dtype=torch.bfloat16))


def loaded(layer: Linear, dtype: torch.dtype) -> Linear:
    gen = torch.Generator().manual_seed(0)
    layer.weight.data = torch.randn(layer.weight.shape, generator=gen).to(dtype)
    if layer.bias is not None:
        layer.bias.data = torch.randn(layer.bias.shape, generator=gen).to(dtype)
    return layer


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bfloat16_linear_equals_f_linear(rows: int, bias: bool):
    layer = loaded(Linear(96, 160, bias=bias), torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.pack_weight()
    assert (layer.packed_weight is not None) == PACKS
    torch.testing.assert_close(layer(x), expected)


def test_a_merged_layer_packs_after_its_shards_load():
    layer = QKVParallelLinear(64, head_dim=16, num_heads=4, num_kv_heads=2)
    for shard, size in layer.output_sizes.items():
        layer.weight_loader(layer.weight, torch.full((size, 64), float(len(shard))), shard)
    layer.weight.data = layer.weight.data.to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    expected = F.linear(x, layer.weight)
    layer.pack_weight()
    torch.testing.assert_close(layer(x), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_other_dtypes_are_not_packed(dtype: torch.dtype):
    assert pack_weight(torch.randn(8, 8, dtype=dtype)) is None
