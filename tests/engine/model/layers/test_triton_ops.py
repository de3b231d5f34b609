"""The decoder layer's Triton kernels against the torch path of the same layers and against
float64 references. Without CUDA they run under Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 before anything imports Triton), on small shapes."""

from __future__ import annotations

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from engine.kernels import custom_op
from engine.kernels.triton import layers as triton_layers
from engine.model.layers.activation import SiluAndMul
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary_embedding import RotaryEmbedding

INTERPRETED = isinstance(triton_layers._rmsnorm_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    not (INTERPRETED or torch.cuda.is_available()), reason="Triton needs CUDA or the interpreter"
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative to the output's dtype: the kernels round where the torch path rounds, but reduce
# in another order.
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers take their Triton branch, here on CPU tensors under the interpreter."""
    monkeypatch.setattr(custom_op, "uses_triton", lambda x: True)


def randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm_kernel_equals_the_torch_path(dtype: torch.dtype, triton_path: None):
    norm = RMSNorm(80, 1e-5).to(DEVICE)
    norm.weight.data = randn(80, dtype=dtype, seed=2)
    x, residual = randn(5, 80, dtype=dtype, scale=3), randn(5, 80, dtype=dtype, seed=1)
    expected_sum = (residual.float() + x.float()).to(dtype)
    expected = norm._norm(expected_sum)
    out, new_residual = norm(x, residual)
    assert new_residual is residual
    # The interpreter rounds float32 to bf16 toward zero, CUDA to nearest: close, not equal.
    torch.testing.assert_close(residual, expected_sum, atol=0, rtol=TOL[dtype])
    torch.testing.assert_close(out, expected, atol=TOL[dtype], rtol=TOL[dtype])
    reference = rms_reference(expected_sum, norm.weight, 1e-5)
    torch.testing.assert_close(out.double(), reference, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    alone = norm(x)
    assert isinstance(alone, torch.Tensor)
    torch.testing.assert_close(alone, norm._norm(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kernel_rotates_q_and_k_in_place_as_the_torch_path(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
):
    rotary = RotaryEmbedding(32, 64, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 5, 63], device=DEVICE)
    cos_sin = rotary.cos_sin(positions, dtype)
    # q and k heads as the model holds them: a strided view into the qkv output.
    qkv = randn(3, 4 + 2 + 2, 32, dtype=dtype)
    qk = qkv[:, :6]
    expected, untouched = qk.clone(), qkv[:, 6:].clone()
    monkeypatch.setattr(custom_op, "uses_triton", lambda x: False)
    rotary(expected, cos_sin)
    monkeypatch.setattr(custom_op, "uses_triton", lambda x: True)
    rotary(qk, cos_sin)
    torch.testing.assert_close(qk, expected, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, 6:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_kernel_equals_the_torch_path(dtype: torch.dtype, triton_path: None):
    x = randn(3, 2 * 1100, dtype=dtype, scale=3)  # two column blocks, the second partial
    gate, up = x.double().chunk(2, dim=-1)
    out = SiluAndMul()(x)
    torch.testing.assert_close(
        out.double(), gate * torch.sigmoid(gate) * up, atol=TOL[dtype] * 8, rtol=TOL[dtype]
    )
    gate_native, up_native = x.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate_native) * up_native
    torch.testing.assert_close(out, expected, atol=TOL[dtype], rtol=TOL[dtype])
