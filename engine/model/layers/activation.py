"""The gated activation of the Llama MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import layers


class SiluAndMul(nn.Module):
    """`silu(gate) * up` over the output of the fused gate_up projection `[T, 2 * d]`: one
    Triton kernel on CUDA, two ops and one allocation on CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if layers.uses_triton(x):
            from engine.model.layers import triton_ops  # imports Triton: CUDA only

            return triton_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
