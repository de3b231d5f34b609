"""The quantized matmul kernels side by side on the embedded model's shapes: PyTorch's own
(`_weight_int4pack_mm_for_cpu`, which holds Q4_0/Q4_1 exactly per group of 32 with zero
point m + 8d; `_weight_int8pack_mm`, int8 rows with one scale each, as `--quantization
int8` holds them) against radixserve's `quant_linear` over the same weights, with float, int16
and int8 activations. Both libraries are asked for the activation dtype they are fastest
at on this path (PyTorch's CPU kernels: bf16). Median microseconds per call over weights
that stay in cache (each call reads its weight from L2/L3): the kernels' own speed; then
one row over more and more copies of a weight, until it streams from memory as in a step.
Results: docs/benchmarks/quantization.md.

    flock /tmp/radixserve-bench.lock .venv/bin/python -m benchmarks.quant_kernels
    RADIXSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python -m benchmarks.quant_kernels
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import gguf
import numpy as np
import torch

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.isa import cpu_isa
from engine.model.layers.quantization import WeightFormat, quantize_int8_rows

SHAPES = [(960, 576, "qkv"), (3072, 576, "gate_up"), (576, 1536, "down"), (49152, 576, "lm_head")]
ROWS = [1, 8]


def micros(fn: Callable[[], object], calls: int = 50) -> float:
    fn()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    assert cpu_build.available(), "the kernels need a compiler"
    isa = cpu_isa()
    print(
        f"kernel path {isa.path}, ATen {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads; CPU flags {' '.join(isa.flags)}; "
        f"load {os.getloadavg()}"
    )
    print(
        "| shape | rows | torch int4pack (bf16) | ours Q4_1 float | ours Q4_1 int16 act. "
        "| ours Q4_1 int8 act. | torch int8pack (bf16) | ours int8 float | ours int8 int16 act. "
        "| ours int8 int8 act. |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for n, k, name in SHAPES:
        weight = rng.standard_normal((n, k)).astype(np.float32)
        q41 = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1)
        blocks = torch.from_numpy(q41.view(np.uint8).reshape(n, -1).copy())
        int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, k), dtype=torch.int32), 1
        )
        scale_zeros = torch.randn(k // 32, n, 2, dtype=torch.bfloat16)
        rows8 = quantize_int8_rows(torch.from_numpy(weight))
        w8, s8 = rows8[:, :k].view(torch.int8).contiguous(), torch.randn(n, dtype=torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            int4pack = torch.ops.aten._weight_int4pack_mm_for_cpu
            ours = cpu_ops.quant_linear
            calls = [
                partial(int4pack, xb, int4, 32, scale_zeros),
                *(partial(ours, x, blocks, int(WeightFormat.Q4_1), None, b) for b in (32, 16, 8)),
                partial(torch.ops.aten._weight_int8pack_mm, xb, w8, s8),
                *(partial(ours, x, rows8, int(WeightFormat.INT8), None, b) for b in (32, 16, 8)),
            ]
            cells = [micros(call) for call in calls]
            print(
                f"| {name} {n}x{k} | {m} | " + " | ".join(f"{c:.0f} us" for c in cells) + " |",
                flush=True,
            )
    k_quants()
    streamed()


def streamed(copies: tuple[int, ...] = (1, 4, 30, 90)) -> None:
    """One row against gate_up's Q4_1 weight, cycling through `copies` copies of it, so that
    from 30 copies on each call reads its weight from L3 or memory, as a decode step does
    (a step reads about 92 MiB). Float sums over as many bytes are the machine's read rate."""
    n, k = 3072, 576
    gguf_blocks = gguf.quants.quantize(
        np.random.default_rng(1).standard_normal((n, k)).astype(np.float32),
        gguf.GGMLQuantizationType.Q4_1,
    )
    weight = torch.from_numpy(gguf_blocks.view(np.uint8).reshape(n, -1).copy())
    x = torch.randn(1, k)
    print("| gate_up Q4_1 copies | MiB | int16 act. per call | GB/s read | float sum GB/s |")
    print("|---|---|---|---|---|")
    for count in copies:
        weights = [weight.clone() for _ in range(count)]
        rounds = max(1, 300 // count)

        def each_copy(weights: list[torch.Tensor] = weights, rounds: int = rounds) -> None:
            for _ in range(rounds):
                for w in weights:
                    cpu_ops.quant_linear(x, w, int(WeightFormat.Q4_1), None, 16)

        per_call = micros(each_copy, calls=1) / (rounds * count)
        floats = torch.rand(count * weight.numel() // 4)
        total = count * weight.numel()
        read_rate = total / micros(floats.sum, 5) / 1e3
        print(
            f"| {count} | {total / 2**20:.0f} | {per_call:.0f} us "
            f"| {weight.numel() / per_call / 1e3:.1f} | {read_rate:.1f} |",
            flush=True,
        )


def k_quants() -> None:
    """One row against a 4096 x 4096 weight in Q4_1, Q4_K and Q6_K (the K-quants' blocks from
    the tests' quantizer: gguf-py only dequantizes them), beside torch's linear over the
    dense weight in bf16."""
    from testing.quant import quantize_blocks

    assert cpu_build.available(), "the kernels need a compiler"
    weight = np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)
    x = torch.randn(1, 4096)
    cells = []
    for kind, bits in [("Q4_1", 32), ("Q4_1", 16), ("Q4_K", 16), ("Q6_K", 16)]:
        qtype = gguf.GGMLQuantizationType[kind]
        rows = torch.from_numpy(np.ascontiguousarray(quantize_blocks(weight, qtype)))
        cells.append(micros(partial(cpu_ops.quant_linear, x, rows, int(qtype), None, bits)))
    dense = torch.from_numpy(weight).bfloat16()
    cells.append(micros(partial(torch.nn.functional.linear, x.bfloat16(), dense)))
    print("| 4096 x 4096, one row | Q4_1 float act. | Q4_1 int16 act. | Q4_K | Q6_K | bf16 dense |")
    print("|---|---|---|---|---|---|")
    print("| us | " + " | ".join(f"{c:.0f}" for c in cells) + " |")


def block_formats(shapes: tuple[tuple[int, int], ...] = ((2048, 640), (640, 2048))) -> None:
    """One row against Gemma 3 270M's weights (2048 x 640: gate or up, K of 20 blocks;
    640 x 2048: down) in each 32-weight format, and the K-quants where K allows, with float,
    int16 and int8 activations: the Q5 formats' fifth bits against their Q4 twins and Q8_0.

        flock /tmp/rs-cpu.lock .venv/bin/python -c \
            "from benchmarks.quant_kernels import block_formats; block_formats()"
    """
    from testing.quant import quantize_blocks

    assert cpu_build.available(), "the kernels need a compiler"
    isa = cpu_isa()
    print(f"kernel path {isa.path}, {torch.get_num_threads()} threads; load {os.getloadavg()}")
    kinds = ["Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K"]
    print("| N x K, one row | activations | " + " | ".join(kinds) + " |")
    print("|---|---|" + "---|" * len(kinds))
    for n, k in shapes:
        weight = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
        x = torch.randn(1, k)
        held = {}
        for kind in kinds:
            qtype = gguf.GGMLQuantizationType[kind]
            if k % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
                rows = quantize_blocks(weight, qtype)
                held[kind] = (torch.from_numpy(np.ascontiguousarray(rows)), int(qtype))
        for bits in (32, 16, 8):
            cells = [
                f"{micros(partial(cpu_ops.quant_linear, x, *held[kind], None, bits), 200):.1f} us"
                if kind in held
                else "-"
                for kind in kinds
            ]
            name = {32: "float", 16: "int16", 8: "int8"}[bits]
            print(f"| {n} x {k} | {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
