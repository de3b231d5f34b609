"""Rotary frequencies and rotation against transformers' own implementation."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.model.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


def hf_config(rope: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=1024,
        num_attention_heads=8,
        max_position_embeddings=131072,
        rope_parameters=dict(rope),
    )


@pytest.mark.parametrize("rope", ["linear", "llama3"])
def test_scaled_frequencies_equal_transformers_bit_for_bit(rope):
    params = {k: v for k, v in ROPES[rope].items() if k != "rope_theta"}
    expected, _ = ROPE_INIT_FUNCTIONS[rope](hf_config(ROPES[rope]))
    assert torch.equal(compute_inv_freq(128, ROPES[rope]["rope_theta"], params), expected)


def rotate_like_transformers(
    config: LlamaConfig, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


def rotate_in_place(
    ours: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the model holds them: adjacent heads of one tensor, rotated together."""
    qk = torch.cat((q, k), dim=1)
    ours(qk, ours.cos_sin(positions, q.dtype))
    return qk[:, : q.shape[1]], qk[:, q.shape[1] :]


@pytest.mark.parametrize("rope", list(ROPES))
def test_rotation_equals_transformers(rope):
    config = hf_config(ROPES[rope])
    params = {k: v for k, v in ROPES[rope].items() if k != "rope_theta"}
    ours = RotaryEmbedding(
        128, 131072, ROPES[rope]["rope_theta"], None if rope == "default" else params
    )
    positions = torch.tensor([0, 1, 7, 8191, 8192, 100000, 131071])
    gen = torch.Generator().manual_seed(0)  # inputs independent of the tests run before
    q = torch.randn(len(positions), 8, 128, dtype=torch.float64, generator=gen)
    k = torch.randn(len(positions), 2, 128, dtype=torch.float64, generator=gen)
    q_hf, k_hf = rotate_like_transformers(config, positions, q, k)
    q_ours, k_ours = rotate_in_place(ours, positions, q, k)
    assert torch.equal(q_ours, q_hf) and torch.equal(k_ours, k_hf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rotation_rounds_as_transformers_does(dtype: torch.dtype, path: str):
    config = hf_config(ROPES["default"])
    ours = RotaryEmbedding(128, 4096, 10000.0)
    positions = torch.tensor([0, 3, 511, 4095])
    q = torch.randn(len(positions), 8, 128).to(dtype)
    k = torch.randn(len(positions), 2, 128).to(dtype)
    q_hf, k_hf = rotate_like_transformers(config, positions, q, k)
    q_ours, k_ours = rotate_in_place(ours, positions, q, k)
    assert torch.equal(q_ours, q_hf) and torch.equal(k_ours, k_hf)


def test_llama_cpp_freq_factors_reproduce_llama3_scaling_to_float32_rounding():
    params = {k: v for k, v in ROPES["llama3"].items() if k != "rope_theta"}
    llama3 = compute_inv_freq(128, 500000.0, params)
    factors = (compute_inv_freq(128, 500000.0).double() / llama3.double()).tolist()
    from_factors = compute_inv_freq(128, 500000.0, freq_factors=factors)
    torch.testing.assert_close(from_factors, llama3, atol=0, rtol=2.5e-7)
