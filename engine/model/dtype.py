"""`--dtype auto`: the activation dtype that is fastest for this engine on the device.

On CUDA bfloat16. On CPU it follows the kernel path (`cpu_isa`): bfloat16 where the CPU
multiplies bf16 natively (AVX512-BF16, AMX), float32 elsewhere, where PyTorch's bf16 GEMM
is an emulation several times slower than its float32 one and the kernels widen 16-bit or
quantized weights to float in registers anyway. docs/benchmarks/cpu-paths.md holds the
measured table this follows.
"""

from __future__ import annotations

import torch

from engine.model.cpu_isa import CpuIsa, cpu_isa


def resolve_dtype(dtype: str, device: torch.device, isa: CpuIsa | None = None) -> str:
    """`dtype` itself, or for `auto` the device's fastest (see the module docstring), on
    this machine's kernel path unless `isa` names another."""
    if dtype != "auto":
        return dtype
    if device.type != "cpu":
        return "bfloat16"
    isa = isa or cpu_isa()
    native_bf16 = isa.path == "amx" or (isa.path == "avx512" and "avx512_bf16" in isa.flags)
    return "bfloat16" if native_bf16 else "float32"
