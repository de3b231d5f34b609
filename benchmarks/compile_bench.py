"""The CPU decode step compiled by `torch.compile` (`--enable-torch-compile`) against the
eager step, on the embedded SmolLM2-135M, in one process: how long the compiled runner
takes to be ready (load plus one compile per bucket), and the median decode step of each
shape, the forward alone (`model_bench.DecodeBench`: contexts mapped to pool slots without
a prefill). Compiled and eager steps alternate, so that other load hits both alike. The
issue's rule: on by default only if at least 15 % faster and ready within 60 s.

    .venv/bin/python -m benchmarks.compile_bench --dtype bfloat16 --shapes "1x512 8x512"

Results: docs/benchmarks/model.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from benchmarks.model_bench import DecodeBench, parse_shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", default="1x512 8x512")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--cache-dir", help="TORCHINDUCTOR_CACHE_DIR (default: a fresh one, a cold compile)"
    )
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp()
    shapes = parse_shapes(args.shapes)
    max_bs = max(b for b, _ in shapes)
    max_steps = 2 * args.steps + 2

    start = time.perf_counter()
    eager = DecodeBench(args.dtype, shapes, max_steps)
    eager_ready = time.perf_counter() - start
    start = time.perf_counter()
    compiled = DecodeBench(
        args.dtype, shapes, max_steps, enable_torch_compile=True, torch_compile_max_bs=max_bs
    )
    compiled_ready = time.perf_counter() - start
    graph_runner = compiled.runner.graph_runner
    assert graph_runner is not None
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; "
        f"buckets {graph_runner.batch_sizes}; ready: eager {eager_ready:.1f} s, "
        f"compiled {compiled_ready:.1f} s (cold inductor cache unless --cache-dir)"
    )
    print("\n| decode batch x context | eager (ms) | compiled (ms) | compiled / eager |")
    print("|---|---:|---:|---:|")
    for i, (batch, context) in enumerate(shapes):
        eager.step_seconds(i), compiled.step_seconds(i)  # warm-up
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.steps):
            times["eager"].append(eager.step_seconds(i))
            times["compiled"].append(compiled.step_seconds(i))
        e, c = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
        print(f"| {batch} x {context} | {e:.1f} | {c:.1f} | {c / e:.2f} |")


if __name__ == "__main__":
    main()
