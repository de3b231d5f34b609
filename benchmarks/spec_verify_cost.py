"""What verifying k draft tokens costs against one decode step: the curve speculative
decoding's draft budget is sized from.

A verify pass scores the last accepted token and k drafts of one request in one forward.
Two shapes can carry it, both measured here over a request holding `--context` tokens of
KV, the forward alone, interleaved round by round (this host's speed drifts):

- `extend`: the k + 1 tokens as one extend over the cached prefix (the prefill path: its
  matmuls run as a GEMM over k + 1 rows, its attention as the extend kernel);
- `decode rows`: k + 1 decode rows, as a decode batch of that size (the decode kernels, a
  row each; each of them reads the whole context).

A draft of k tokens pays off when its expected accepted length exceeds the verify cost in
decode steps; the ratio column is that cost.

    flock /tmp/radixserve-bench.lock .venv/bin/python -m benchmarks.spec_verify_cost
    RADIXSERVE_CPU_ISA=avx2 .venv/bin/python -m benchmarks.spec_verify_cost --dtype float32

Results are recorded in docs/benchmarks/speculative.md.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.model_bench import DecodeBench
from engine.kernels.cpu.isa import cpu_isa
from engine.model.dtype import resolve_dtype, resolve_kv_cache_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", help="as --dtype (auto: this CPU's pick)")
    parser.add_argument("--quantization", default="gguf", help="gguf (as stored) or none")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    dtype = resolve_dtype(args.dtype, cpu)
    sizes = sorted({1, *(k + 1 for k in args.drafts)})
    bench = DecodeBench(
        dtype,
        [(b, args.context) for b in sizes],
        max_steps=args.rounds + 1,
        spare_tokens=(max(args.drafts) + 1) * 2,
        device="cpu",
        quantization=args.quantization,
        kv_cache_dtype=resolve_kv_cache_dtype("auto", args.dtype, dtype, cpu),
    )
    decode: dict[int, list[float]] = {b: [] for b in sizes}
    extend: dict[int, list[float]] = {k: [] for k in args.drafts}
    for shape in range(len(sizes)):  # warm every shape once
        bench.step_seconds(shape)
    bench.prefill_seconds(0, max(args.drafts) + 1)
    for _ in range(args.rounds):
        for shape, b in enumerate(sizes):
            decode[b].append(bench.step_seconds(shape))
        for k in args.drafts:
            extend[k].append(bench.prefill_seconds(0, k + 1))
    one = statistics.median(decode[1]) * 1e3
    rows = []
    for k in args.drafts:
        extend_ms = statistics.median(extend[k]) * 1e3
        rows_ms = statistics.median(decode[k + 1]) * 1e3
        rows.append(
            {
                "drafts": k,
                "extend_ms": round(extend_ms, 2),
                "extend_x_decode": round(extend_ms / one, 2),
                "decode_rows_ms": round(rows_ms, 2),
                "decode_rows_x_decode": round(rows_ms / one, 2),
            }
        )
    report = {
        "cpu": cpu_isa().describe(),
        "dtype": dtype,
        "weights": bench.runner.weights_format,
        "kv_cache_dtype": str(bench.runner.kv_cache_dtype).removeprefix("torch."),
        "context": args.context,
        "decode_step_ms": round(one, 2),
        "rows": rows,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
