"""`--dtype auto`: the activation dtype that is fastest for this engine on the device, and
`--kv-cache-dtype auto`: what its KV cache holds.

On CUDA bfloat16. On CPU it follows the kernel path (`cpu_isa`): bfloat16 where the CPU
multiplies bf16 natively (AVX512-BF16, AMX), float32 elsewhere, where PyTorch's bf16 GEMM
is an emulation several times slower than its float32 one and the kernels widen 16-bit or
quantized weights to float in registers anyway. docs/benchmarks/cpu-paths.md holds the
measured table this follows.

The KV cache holds the dtype, except under the float32 that `--dtype auto` picks on CPU:
there it holds float16, which the kernels widen in registers as they read it (one F16C
instruction per 8 values), so decode attention reads half the bytes; llama.cpp's cache
holds float16 by default too.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu.isa import CpuIsa, cpu_isa


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


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, dtype_setting: str, dtype: str, device: torch.device
) -> str:
    """`kv_cache_dtype` itself, or for `auto`: float16 where `dtype_setting` was `auto` and
    chose float32 on CPU, else `dtype` (the resolved one). The runner refuses what its
    kernels do not read."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    picked_float32 = device.type == "cpu" and dtype_setting == "auto" and dtype == "float32"
    return "float16" if picked_float32 else dtype
