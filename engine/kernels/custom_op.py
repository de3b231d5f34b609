"""One dispatch rule for every layer that has kernels of its own (vLLM's and SGLang's
`CustomOp`): the layer writes `forward_native` (torch ops: any device, the reference the
kernels are tested against), `forward_cpu` (the C++ library, `engine/kernels/cpu`) and
`forward_cuda` (Triton, `engine/kernels/triton`), and `CustomOp.forward` picks one by the
first tensor argument. Code that calls a kernel outside such a layer (the matmul helper
`linear`, a model's one-op decode layer, LoRA) asks the same two questions here:
`uses_triton` and `cpu_kernels_on`. tests/engine/kernels/test_dispatch.py fails on any
layer module that asks them another way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.kernels.cpu import build as cpu_build


def uses_triton(x: torch.Tensor) -> bool:
    """Whether `x` (a CUDA tensor) takes the Triton kernels. One seam for all layers, so that
    tests can run the kernels on CPU under Triton's interpreter."""
    return x.is_cuda


def cpu_kernels_on(x: torch.Tensor) -> bool:
    """Whether `x` takes the C++ kernels: a CPU tensor, the library loaded, and an eager run
    (under `torch.compile` the layers stay torch ops, which inductor fuses itself)."""
    return x.device.type == "cpu" and cpu_build.enabled()


class CustomOp(nn.Module):
    """A layer with a kernel per device kind. Subclasses override `forward_native` and
    whichever of `forward_cpu` / `forward_cuda` they have (each falls back to the native
    one), and `cpu_supports` where the C++ kernel takes only some inputs (dtypes, shapes)."""

    forward_native: Callable[..., Any]
    """Torch ops on any device: the reference the kernels are tested against. Every subclass
    defines it."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.dispatch(x)(x, *args, **kwargs)

    def dispatch(self, x: torch.Tensor) -> Callable[..., Any]:
        """The forward that runs `x`: Triton on CUDA, the C++ kernel on CPU where it is
        loaded and takes `x`, else torch ops."""
        if uses_triton(x):
            return self.forward_cuda
        if cpu_kernels_on(x) and self.cpu_supports(x):
            return self.forward_cpu
        return self.forward_native

    def cpu_supports(self, x: torch.Tensor) -> bool:
        """Whether the C++ kernel takes `x`; every input unless a subclass says otherwise."""
        return True

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)
