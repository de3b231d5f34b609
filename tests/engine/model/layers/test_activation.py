"""SiluAndMul and GeluAndMul against transformers' activations: bit for bit through torch
ops; within a unit of rounding through the C++ kernels, which take 16-bit rows on CPU (their
exp is a polynomial)."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from engine.kernels.cpu import ops as cpu_ops
from engine.model.layers.activation import GeluAndMul, SiluAndMul


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_gelu_and_mul_equals_transformers(dtype: torch.dtype, path: str, monkeypatch):
    """Gemma's `gelu_pytorch_tanh`; the kernel's value is x * sigmoid(2y), torch's
    x/2 (1 + tanh(y)), which cancels for negative x: the kernel is never further from the
    exact value than torch, but for one 16-bit unit per rounding."""
    x = (torch.randn(7, 2 * 80, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = ACT2FN["gelu_pytorch_tanh"](gate) * up
    calls, kernel = [], cpu_ops.gelu_tanh_and_mul
    monkeypatch.setattr(cpu_ops, "gelu_tanh_and_mul", lambda t: calls.append(t) or kernel(t))
    out = GeluAndMul()(x)
    assert len(calls) == (path == "kernel" and dtype in (torch.bfloat16, torch.float16))
    if calls:
        g = gate.double()
        exact = g * torch.sigmoid(1.5957691216057308 * (g + 0.044715 * g**3)) * up.double()
        unit = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
        slack = exact.abs() * 2 * unit + 2 * unit * torch.finfo(dtype).smallest_normal
        assert ((out.double() - exact).abs() <= (expected.double() - exact).abs() + slack).all()
    else:
        assert torch.equal(out, expected)
