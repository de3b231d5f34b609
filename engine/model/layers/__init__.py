"""The building blocks the models are assembled from (names follow SGLang and vLLM)."""

from __future__ import annotations

import torch


def uses_triton(x: torch.Tensor) -> bool:
    """Whether a layer runs its Triton kernel on `x` (CUDA tensors) rather than torch ops.
    One seam for all layers, so that tests can run the kernels on CPU under Triton's
    interpreter."""
    return x.is_cuda
