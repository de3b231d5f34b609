"""The gated activation of the Llama MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import cpu_kernels, layers


class SiluAndMul(nn.Module):
    """`silu(gate) * up` over the output of the fused gate_up projection `[T, 2 * d]`: one
    Triton kernel on CUDA, one C++ op for 16-bit rows on CPU (`cpu_kernels.silu_and_mul`),
    else two ops and one allocation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if layers.uses_triton(x):
            from engine.model.layers import triton_ops  # imports Triton: CUDA only

            return triton_ops.silu_and_mul(x)
        if (
            x.dtype in (torch.bfloat16, torch.float16)
            and x.device.type == "cpu"
            and x.dim() == 2
            and cpu_kernels.enabled()
        ):
            return cpu_kernels.silu_and_mul(x.contiguous())
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
