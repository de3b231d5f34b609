"""SiluAndMul against transformers' Llama MLP activation: bit for bit through torch ops;
within one unit of rounding through the C++ kernel, which takes 16-bit rows on CPU (its
sigmoid's exp is a polynomial)."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from engine.kernels.cpu import ops as cpu_ops
from engine.model.layers.activation import SiluAndMul


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_silu_and_mul_equals_transformers(dtype: torch.dtype, path: str, monkeypatch):
    x = (torch.randn(7, 2 * 80, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = ACT2FN["silu"](gate) * up
    calls, kernel = [], cpu_ops.silu_and_mul
    monkeypatch.setattr(cpu_ops, "silu_and_mul", lambda t: calls.append(t) or kernel(t))
    out = SiluAndMul()(x)
    assert len(calls) == (path == "kernel" and dtype in (torch.bfloat16, torch.float16))
    if calls:
        unit = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
        assert ((out.float() - expected.float()).abs() <= expected.float().abs() * unit).all()
        assert (out == expected).float().mean() > 0.99
    else:
        assert torch.equal(out, expected)
