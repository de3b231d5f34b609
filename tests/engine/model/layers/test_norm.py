"""RMSNorm against transformers' LlamaRMSNorm, bit for bit, alone and fused with the
residual add."""

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


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_equals_transformers_bit_for_bit(dtype: torch.dtype):
    ours, hf = norms(dtype)
    x = rows(300, dtype, seed=0)
    assert torch.equal(ours(x), hf(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_writes_the_sum_into_the_residual_and_normalises_it(dtype: torch.dtype):
    ours, hf = norms(dtype)
    x, residual = rows(300, dtype, seed=0), rows(300, dtype, seed=1)
    expected_sum = residual + x
    out, new_residual = ours(x, residual)
    assert new_residual is residual and torch.equal(residual, expected_sum)
    assert torch.equal(out, hf(expected_sum))
