"""RMSNorm against transformers' LlamaRMSNorm, alone and fused with the residual add: bit
for bit through torch ops; within one unit of rounding through the C++ kernel, which takes
bf16 on CPU (its sum of squares is ordered differently)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine.model.layers.norm import RMSNorm

DTYPES = [torch.bfloat16, torch.float32, torch.float64]


def norms(dtype: torch.dtype, hidden: int = 96) -> tuple[RMSNorm, LlamaRMSNorm]:
    weight = torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours, hf = RMSNorm(hidden, 1e-5), LlamaRMSNorm(hidden, eps=1e-5)
    ours.weight.data, hf.weight.data = weight.clone(), weight.clone()
    return ours, hf


def rows(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 96, generator=gen) * torch.rand(n, 1, generator=gen) * 8).to(dtype)


def assert_matches(ours: torch.Tensor, theirs: torch.Tensor, path: str) -> None:
    if path == "torch-ops" or ours.dtype not in (torch.bfloat16, torch.float16):
        assert torch.equal(ours, theirs)
    else:  # two units of bf16 rounding: the normalised value's and the product's
        assert ((ours.float() - theirs.float()).abs() <= theirs.float().abs() * 2.0**-6).all()
        assert (ours == theirs).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_equals_transformers(dtype: torch.dtype, path: str):
    ours, hf = norms(dtype)
    x = rows(300, dtype, seed=0)
    assert_matches(ours(x), hf(x), path)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_writes_the_sum_into_the_residual_and_normalises_it(
    dtype: torch.dtype, path: str
):
    ours, hf = norms(dtype)
    x, residual = rows(300, dtype, seed=0), rows(300, dtype, seed=1)
    expected_sum = residual + x
    out, new_residual = ours(x, residual)
    assert new_residual is residual and torch.equal(residual, expected_sum)
    assert_matches(out, hf(expected_sum), path)
