"""What --enable-deterministic-inference costs the matmuls of a step, per row count: one
layer's four projections (qkv, o, gate_up, down) of the embedded model, its quantized
weights as served, multiplied by `m` rows through the default kernels (integer rows up to
2, the register path to 16, the widened GEMM above) and through the mode's one path at
every row count (float activations, the register path).

    flock /tmp/radixserve-bench.lock .venv/bin/python -m benchmarks.invariant_matmul_cost
    RADIXSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python -m benchmarks.invariant_matmul_cost

Prints one JSON object (ms per layer, median of rounds); recorded in
docs/benchmarks/determinism.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.kernels.cpu.isa import cpu_isa
from engine.model.dtype import resolve_dtype
from engine.model.layers.linear import Linear, linear
from engine.model.runner import ModelRunner

VARIANTS = {  # name -> (activation bits, batch_invariant)
    "default": (16, False),
    "invariant": (32, True),
}


def layer_ms(
    projections: list[Linear], rows: int, dtype: torch.dtype, bits: int, invariant: bool
) -> float:
    """Median ms of the layer's four matmuls for `rows` random rows."""
    inputs = [torch.randn(rows, p.input_size).to(dtype) for p in projections]

    def once() -> None:
        for p, x in zip(projections, inputs):
            linear(x, p.weight, None, None, p.quant_format, bits, invariant)

    once()
    times = []
    for _ in range(7):
        started = time.perf_counter()
        once()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    args = parser.parse_args()
    dtype = resolve_dtype("auto", torch.device("cpu"))
    runner = ModelRunner("embedded", dtype=dtype, quantization="gguf", max_total_tokens=256)
    dtype = runner.dtype
    layer = runner.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    results: dict[int, dict[str, float]] = {}
    for rows in args.rows:
        results[rows] = {
            name: round(layer_ms(projections, rows, dtype, *variant), 3)
            for name, variant in VARIANTS.items()
        }
        print(json.dumps({"rows": rows, **results[rows]}), flush=True)
    report = {"cpu": cpu_isa().describe(), "dtype": str(dtype), "ms_per_layer": results}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
