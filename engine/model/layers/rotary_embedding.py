"""Rotary position embedding (rotate-half layout), with linear and llama3 frequency scaling."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.custom_op import CustomOp


def compute_inv_freq(
    head_dim: int,
    base: float,
    rope_scaling: Mapping[str, Any] | None = None,
    freq_factors: Sequence[float] | None = None,
) -> torch.Tensor:
    """The `head_dim / 2` rotary frequencies in float32, computed with the same operations
    as transformers so that both see the same angles.

    `freq_factors` are llama.cpp's per-frequency divisors: how a GGUF file stores llama3
    scaling.
    """
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim)
    )
    scaling: Mapping[str, Any] = rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported")
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between
    interpolated smoothly."""
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)


class RotaryEmbedding(CustomOp):
    """Rotates q and k by their token's position. cos/sin are tabulated once in float32 for
    every position up to `max_position` (one table shared by all layers), gathered once per
    forward for the batch's positions and cast to the activations' dtype, as transformers
    does; each layer then rotates its q and k heads together, in place: one Triton kernel on
    CUDA, one C++ op on CPU (`cpu_ops.rotary`), where torch dispatches four."""

    cos_sin_cache: torch.Tensor  # [max_position, 2, head_dim / 2] float32: cos, sin

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: Mapping[str, Any] | None = None,
        freq_factors: Sequence[float] | None = None,
    ):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, base, rope_scaling, freq_factors)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer(
            "cos_sin_cache", torch.stack((freqs.cos(), freqs.sin()), dim=1), persistent=False
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`[T, 2, 1, head_dim]` in `dtype` for `positions` `[T]`: cos, then sin with its
        first half negated, so that `x * cos + roll(x, head_dim / 2) * sin` is transformers'
        `x * cos + rotate_half(x) * sin` with the same roundings."""
        half = self.cos_sin_cache.index_select(0, positions)
        table = torch.cat((half, half), dim=-1)
        table[:, 1, : self.head_dim // 2].neg_()
        return table.to(dtype).unsqueeze(2)

    def forward(self, qk: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """Rotate `qk` `[T, heads, head_dim]` (q's heads, then k's: a view into the fused qkv
        projection's output) in place; `cos_sin` from `cos_sin`."""
        self.dispatch(qk)(qk, cos_sin)

    def cpu_supports(self, x: torch.Tensor) -> bool:
        return x.dtype != torch.float64

    def forward_cpu(self, qk: torch.Tensor, cos_sin: torch.Tensor) -> None:
        cpu_ops.rotary(qk, cos_sin)

    def forward_cuda(self, qk: torch.Tensor, cos_sin: torch.Tensor) -> None:
        from engine.kernels.triton import layers as triton_layers  # imports Triton

        triton_layers.rotary_(qk, cos_sin)

    def forward_native(self, qk: torch.Tensor, cos_sin: torch.Tensor) -> None:
        cos, sin = cos_sin.unbind(1)
        rotated = torch.roll(qk, self.head_dim // 2, dims=-1).mul_(sin)
        qk.mul_(cos).add_(rotated)
