"""An int8 GEMM (`torch._int_mm`, int8 x int8 -> int32 through oneDNN) against a float32
`mm` on the prefill's matmul shapes of the embedded model (256 tokens x its projections):
what an integer prefill could gain on this CPU path (docs/benchmarks/cpu-paths.md), and
whether the product is exact: without VNNI, oneDNN multiplies int8 pairs with vpmaddubsw,
whose int16 pair sums saturate unless the weights fit 7 bits ("error" is the largest
difference from the int64 product, for full-range and for 7-bit weights).

    flock /tmp/radixserve-bench.lock .venv/bin/python -m benchmarks.int8_gemm
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python -m benchmarks.int8_gemm
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch

SHAPES = [(256, 576, 1536), (256, 1536, 576), (256, 576, 3072)]
"""(tokens, in, out): o/down-sized, down, gate_up."""


def seconds(call: Callable[[], torch.Tensor], repeats: int = 20) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def int_mm_error(a: torch.Tensor, b: torch.Tensor) -> int:
    exact = a.long() @ b.long()
    return int((torch._int_mm(a, b).long() - exact).abs().max())


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"ATen {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        a8 = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
        b8 = torch.randint(-127, 128, (k, n), generator=gen, dtype=torch.int8)
        b7 = b8.clamp(-63, 63)
        work = 2 * m * k * n
        f32 = seconds(partial(torch.mm, a, b))
        i8 = seconds(partial(torch._int_mm, a8, b8))
        errors = [int_mm_error(a8, w) for w in (b8, b7)]
        print(
            f"{m} {k} {n} f32 {f32 * 1e3:.2f} ms ({work / f32 / 1e9:.0f} GF)  "
            f"int_mm {i8 * 1e3:.2f} ms ({work / i8 / 1e9:.0f} GOP), error {errors[0]} "
            f"(7-bit weights: {errors[1]})"
        )


if __name__ == "__main__":
    main()
