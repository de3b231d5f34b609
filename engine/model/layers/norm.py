"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.custom_op import CustomOp


class RMSNorm(CustomOp):
    """`weight * x / rms(x)`, rounded where Hugging Face rounds (normalised in float32 and
    cast back before the weight, even for a float64 model), so that logits match the
    reference bit for bit where they can.

    With `residual`, adds `x` to it first, in place, and also returns it: the next residual
    (SGLang's fused add + RMSNorm). On CUDA one Triton kernel does both; on CPU, where each
    op costs its dispatch at decode sizes, one C++ op does both for 16-bit activations
    (`cpu_ops.rms_norm`: its float sum of squares is ordered differently, so a value can
    round one unit apart from transformers), and `F.rms_norm` does the float32 part in one op
    otherwise.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = self.dispatch(x)(x, residual)
        return out if residual is None else (out, residual)

    def cpu_supports(self, x: torch.Tensor) -> bool:
        return x.dtype in (torch.bfloat16, torch.float16)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is not None:
            x = residual.add_(x)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        shape, eps = self.weight.shape, self.variance_epsilon
        if x.dtype == torch.float32:  # no rounding between the norm and the weight
            return F.rms_norm(x, shape, self.weight, eps)
        if x.dtype == torch.float64:
            return F.rms_norm(x.float(), shape, eps=eps).to(x.dtype).mul_(self.weight)
        # Half dtypes: F.rms_norm computes in float32 and rounds once, as transformers does.
        return F.rms_norm(x, shape, eps=eps).mul_(self.weight)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2:  # a layer's hidden states: no reshape to dispatch
            return cpu_ops.rms_norm(x.contiguous(), residual, self.weight, self.variance_epsilon)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        residual_rows = None if residual is None else residual.view(rows.shape)
        out = cpu_ops.rms_norm(rows, residual_rows, self.weight, self.variance_epsilon)
        return out.view(x.shape)

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        from engine.kernels.triton import layers as triton_layers  # imports Triton

        rows = x.reshape(-1, x.shape[-1])
        return triton_layers.rmsnorm(rows, self.weight, self.variance_epsilon, residual).view(
            x.shape
        )
