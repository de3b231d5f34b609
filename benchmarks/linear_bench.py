"""CPU bf16 matmul micro-benchmark: one projection of the embedded model's shapes
(SmolLM2-135M: qkv, o, gate_up, down, lm_head) through oneDNN's packed kernel, the AMX
kernel and the few-rows kernel (`engine/model/cpu_ops.py`), at decode and prefill row
counts.

Each case cycles through enough distinct copies of the weight (30, as the model's layers;
4 for the lm_head) that every call reads its weight from memory, as a decode step does, and
reports µs per call and the weight bytes read per second. The few-rows kernel is shown up
to 4 rows (the engine takes it up to `cpu_ops.FEW_ROWS`); a kernel this CPU lacks (AMX,
oneDNN's bf16) is left out.

Run: .venv/bin/python -m benchmarks.linear_bench [--rows 1 2 4 8 32 512]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.model.layers.linear import PACK_BATCH_HINT, mkldnn_packing_applies

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
FEW_ROWS_SHOWN = 4


def seconds_per_call(calls: list[Callable[[], torch.Tensor]], repeats: int = 7) -> float:
    """Median over `repeats` passes through `calls` (one per weight copy), per call."""
    for call in calls:
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] / len(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32, 512])
    args = parser.parse_args()
    assert cpu_build.available(), "the CPU kernels could not be built"
    onednn = mkldnn_packing_applies(torch.empty(1, dtype=torch.bfloat16))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"AMX kernel: {cpu_ops.amx_available()}, oneDNN bf16: {onednn}"
    )
    print("\n| weight | rows | kernel | µs per call | GB/s of weight |\n|---|---:|---|---:|---:|")
    for name, (n, k) in SHAPES.items():
        copies = 4 if name == "lm_head" else 30
        weights = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        packed_onednn = (
            [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in weights]
            if onednn
            else []
        )
        packed_amx = [p for p in map(cpu_ops.amx_pack, weights) if p is not None]
        for rows in args.rows:
            x = torch.randn(rows, k).bfloat16()
            kernels: dict[str, list[Callable[[], torch.Tensor]]] = {}
            if packed_onednn:
                pointwise = torch.ops.mkldnn._linear_pointwise
                kernels["oneDNN"] = [
                    partial(pointwise, x, p, None, "none", [], "") for p in packed_onednn
                ]
            if packed_amx:
                kernels["AMX"] = [partial(cpu_ops.linear_amx, x, p, n) for p in packed_amx]
            if rows <= FEW_ROWS_SHOWN:
                kernels["few rows"] = [partial(cpu_ops.linear_few_rows, x, w) for w in weights]
            for kernel, calls in kernels.items():
                seconds = seconds_per_call(calls)
                print(
                    f"| {name} {n}x{k} | {rows} | {kernel} | {seconds * 1e6:.1f} | "
                    f"{n * k * 2 / seconds / 1e9:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
