"""The gated activations of the MLPs: `act(gate) * up` over the fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """`silu(gate) * up` over the output of the fused gate_up projection `[T, 2 * d]`: one
    Triton kernel on CUDA, one C++ op for 16-bit rows on CPU (`cpu_ops.silu_and_mul`),
    else two ops and one allocation."""

    def cpu_supports(self, x: torch.Tensor) -> bool:
        return x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.silu_and_mul(x.contiguous())

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels.triton import layers as triton_layers  # imports Triton

        return triton_layers.silu_and_mul(x)


class GeluAndMul(CustomOp):
    """`gelu_tanh(gate) * up` (Gemma's `gelu_pytorch_tanh`): one C++ op for 16-bit rows on
    CPU (`cpu_ops.gelu_tanh_and_mul`), else two torch ops."""

    def cpu_supports(self, x: torch.Tensor) -> bool:
        return x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.gelu_tanh_and_mul(x.contiguous())


GATED_ACTIVATIONS: dict[str, type[CustomOp]] = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": GeluAndMul,
}
"""A config's `hidden_act` -> its gated layer (`ModelConfig` refuses any other)."""
