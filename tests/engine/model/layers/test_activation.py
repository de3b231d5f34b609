"""SiluAndMul against transformers' Llama MLP activation, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from engine.model.layers.activation import SiluAndMul


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_silu_and_mul_equals_transformers_bit_for_bit(dtype: torch.dtype):
    x = (torch.randn(7, 2 * 80, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(SiluAndMul()(x), ACT2FN["silu"](gate) * up)
