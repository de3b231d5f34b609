"""Decode and prefill speed of the embedded model per CPU kernel path, activation dtype and
weight format: one process per path (`RADIXSERVE_CPU_ISA` forces the path, and with it
ATen's and oneDNN's ISA) holding a runner per configuration, their steps interleaved round
by round, side by side in one run. The table behind
`--dtype auto` and `--quantization auto` (docs/benchmarks/cpu-paths.md).

A decode step is the forward alone of a batch whose requests hold `context` tokens of KV
(benchmarks/model_bench.py's DecodeBench), reported beside its memory floor: the bytes
it reads (every weight once as held, packed blocks included, plus the batch's K/V) at the
machine's copy bandwidth.

    flock /tmp/radixserve-bench.lock .venv/bin/python -m benchmarks.cpu_paths
    .venv/bin/python -m benchmarks.cpu_paths --paths avx2 --configs float32:gguf bfloat16:none
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = [
    "float32:gguf:int16:float16",
    "float32:gguf:int16",
    "float32:gguf:float",
    "float32:gguf:int8",
    "bfloat16:gguf:int16",
    "bfloat16:gguf:float",
    "float32:none",
    "bfloat16:none",
]
SHAPES = [(1, 256), (8, 512)]


def measure(
    configs: list[str], shapes: list[tuple[int, int]], steps: int, prefill: int
) -> list[dict[str, object]]:
    """In this process (its path already forced): step times and sizes of each
    `dtype:quantization[:activations[:kv_cache_dtype]]` config (the KV cache holding the
    dtype unless it says), one runner each, their steps interleaved
    (round by round, every config in turn) so that the machine's slower and faster
    moments fall on all of them alike."""
    import statistics

    import torch

    from benchmarks.model_bench import DecodeBench, copy_bandwidth
    from engine.kernels.cpu.isa import cpu_isa

    benches = []
    for config in configs:
        fields = config.split(":")
        dtype, quantization = fields[:2]
        activations = fields[2] if len(fields) > 2 else "int16"
        kv_cache_dtype = fields[3] if len(fields) > 3 else None
        bench = DecodeBench(
            dtype,
            shapes,
            steps + 2,
            spare_tokens=prefill,
            quantization=quantization,
            quantized_activations=activations,
            kv_cache_dtype=kv_cache_dtype,
        )
        benches.append((dtype, quantization, activations, bench))
    bandwidth = copy_bandwidth()
    step_times: list[list[list[float]]] = [[[] for _ in shapes] for _ in benches]
    for index in range(len(shapes)):
        for *_, bench in benches:
            bench.step_seconds(index)  # warm-up
    for _ in range(steps):
        for times, (*_, bench) in zip(step_times, benches):
            for index in range(len(shapes)):
                times[index].append(bench.step_seconds(index))
    prefill_times: list[list[float]] = [[] for _ in benches]
    if prefill:
        for _ in range(3):  # the first is a warm-up
            for times, (*_, bench) in zip(prefill_times, benches):
                times.append(bench.prefill_seconds(0, prefill))
    results: list[dict[str, object]] = []
    for (dtype, quantization, activations, bench), times, prefills in zip(
        benches, step_times, prefill_times
    ):
        sizes = bench.sizes()
        decode = []
        for (batch, context), shape_times in zip(shapes, times):
            step = statistics.median(shape_times)
            floor = (sizes["weight_bytes"] + batch * context * sizes["kv_token_bytes"]) / bandwidth
            decode.append(
                {"batch": batch, "context": context, "step_ms": step * 1e3, "floor_ms": floor * 1e3}
            )
        results.append(
            {
                "path": cpu_isa().path,
                "aten": torch.backends.cpu.get_cpu_capability(),
                "dtype": dtype,
                "weights": bench.runner.weights_format
                + (f" ({activations} act.)" if quantization != "none" else ""),
                "kv": str(bench.runner.token_to_kv_pool.dtype).removeprefix("torch."),
                "weight_mib": sizes["weight_bytes"] / (1 << 20),
                "bandwidth_gbs": bandwidth / 1e9,
                "decode": decode,
                "prefill_tps": prefill / min(prefills[1:]) if prefill else 0.0,
            }
        )
    return results


def run_path(path: str, configs: list[str], steps: int, prefill: int) -> list[dict[str, object]]:
    env = {**os.environ, "RADIXSERVE_CPU_ISA": path}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.cpu_paths",
            "--child",
            *configs,
            "--steps",
            str(steps),
            "--prefill",
            str(prefill),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return [{"path": path, "error": out.stderr.strip().splitlines()[-1:]}]
    results: list[dict[str, object]] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", nargs="+", help="default: every path this machine allows")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=DEFAULT_CONFIGS,
        help="dtype:quantization[:int16|int8|float activations, default int16[:KV cache "
        "dtype, default the dtype]]",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prefill", type=int, default=512, help="prefill tokens (0: skip)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        apply_first()
        print(json.dumps(measure(args.child, SHAPES, args.steps, args.prefill)))
        return
    from engine.kernels.cpu.isa import FORCEABLE, PATHS, cpu_isa

    machine = cpu_isa()
    paths = args.paths or [p for p in FORCEABLE if PATHS.index(p) <= PATHS.index(machine.path)]
    print(f"CPU flags: {' '.join(machine.flags)}; load average {os.getloadavg()}")
    header = (
        "| path | ATen | dtype | weights | KV | MiB | "
        + " | ".join(f"decode {b}x{c} ms (floor)" for b, c in SHAPES)
        + " | prefill tok/s |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for path in paths:
        for r in run_path(path, args.configs, args.steps, args.prefill):
            if "error" in r:
                print(f"| {path} | | error: {r['error']} |", flush=True)
                continue
            cells = " | ".join(
                f"{d['step_ms']:.1f} ({d['floor_ms']:.1f}, {d['step_ms'] / d['floor_ms']:.2f}x)"
                for d in r["decode"]  # type: ignore[union-attr]
            )
            print(
                f"| {r['path']} | {r['aten']} | {r['dtype']} | {r['weights']} | {r['kv']} | "
                f"{r['weight_mib']:.0f} | {cells} | {r['prefill_tps']:.0f} |",
                flush=True,
            )


def apply_first() -> None:
    """Apply the forced path before torch's first dispatch in this process."""
    from engine.kernels.cpu.isa import apply_forced_isa

    apply_forced_isa()


if __name__ == "__main__":
    main()
