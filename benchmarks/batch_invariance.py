"""Does a request's decode step give the same logits whatever else is in its batch? One
request's next-token logits decoded alone and among 1..N other requests (other prompts,
other lengths), compared bitwise; batch sizes that give the same logits form one regime.
A batch-invariant step has one regime.

    RADIXSERVE_CPU_ISA=avx2 .venv/bin/python -m benchmarks.batch_invariance
    .venv/bin/python -m benchmarks.batch_invariance --library-gemm
    .venv/bin/python -m benchmarks.batch_invariance --deterministic

`--library-gemm` asks the same of the CPU's library GEMM (`torch.mm`, oneDNN or MKL) alone:
row 0 of `x[:m] @ w.T` for m = 1 … 4096, per dtype, at the embedded model's MLP shape.

Prints one JSON object; results are recorded in docs/benchmarks/determinism.md.
"""

from __future__ import annotations

import argparse
import json

import torch

from engine.kernels.cpu.isa import cpu_isa
from engine.model.dtype import resolve_dtype, resolve_kv_cache_dtype
from engine.model.runner import ModelRunner
from testing.batches import ExtendInput, build_forward_batch

PROBE = [1, 504, 3100, 280, 9012, 42, 77, 1234, 18, 99] * 3


def regimes(outputs: dict[int, torch.Tensor]) -> dict[int, int]:
    """Batch size -> its regime: sizes whose outputs are equal bit for bit share one."""
    seen: list[torch.Tensor] = []
    regime_of: dict[int, int] = {}
    for size, out in outputs.items():
        same = [i for i, s in enumerate(seen) if torch.equal(s, out)]
        if not same:
            seen.append(out)
        regime_of[size] = same[0] if same else len(seen) - 1
    return regime_of


def library_gemm_regimes() -> dict[str, dict[int, int]]:
    torch.manual_seed(0)
    sizes = [1, 2, 3, 4, 8, 16, 17, 32, 64, 100, 128, 256, 512, 1000, 1024, 2048, 4096]
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(1536, 576).to(dtype)
        x = torch.randn(max(sizes), 576).to(dtype)
        report[str(dtype)] = regimes({m: torch.mm(x[:m], w.t())[0] for m in sizes})
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="gguf", help="gguf (as stored) or none")
    parser.add_argument("--quantized-activations", default="int16", help="int16, int8 or float")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 17, 32])
    parser.add_argument("--library-gemm", action="store_true")
    parser.add_argument(
        "--deterministic", action="store_true", help="with --enable-deterministic-inference"
    )
    args = parser.parse_args()
    if args.library_gemm:
        print(json.dumps({"cpu": cpu_isa().describe(), **library_gemm_regimes()}, indent=2))
        return
    cpu = torch.device("cpu")
    dtype = resolve_dtype(args.dtype, cpu)
    largest = max(args.batch_sizes)
    runner = ModelRunner(
        "embedded",
        dtype=dtype,
        quantization=args.quantization,
        quantized_activations=args.quantized_activations,
        kv_cache_dtype=resolve_kv_cache_dtype("auto", args.dtype, dtype, cpu),
        max_total_tokens=8192,
        max_running_requests=largest + 1,
        enable_deterministic_inference=args.deterministic,
    )
    prompts = [PROBE] + [[(7 * i + j) % 4000 + 10 for j in range(20 + i)] for i in range(largest)]
    rows = runner.req_to_token_pool.alloc(largest)
    assert rows is not None
    for row, ids in zip(rows, prompts):  # each prompt's KV, prefilled alone
        slots = runner.token_to_kv_pool_allocator.alloc(len(ids))
        assert slots is not None
        runner.req_to_token_pool.write(row, 0, slots)
        runner.forward(build_forward_batch(runner, [ExtendInput(row, 0, ids)]))

    def probe_logits(batch_size: int) -> torch.Tensor:
        """The probe's logits for its next token, decoded as row 0 of `batch_size` rows."""
        batch = [ExtendInput(r, len(ids), [55]) for r, ids in zip(rows[:batch_size], prompts)]
        forward_batch = build_forward_batch(runner, batch)
        logits = runner.forward(forward_batch)[0].clone()
        runner.token_to_kv_pool_allocator.free(forward_batch.out_cache_loc)
        return logits

    logits = {batch_size: probe_logits(batch_size) for batch_size in args.batch_sizes}
    regime_of = regimes(logits)
    report = {
        "cpu": cpu_isa().describe(),
        "dtype": dtype,
        "weights": runner.weights_format,
        "regime_of_batch_size": regime_of,
        "max_abs_diff_from_alone": {
            b: (out - logits[args.batch_sizes[0]]).abs().max().item() for b, out in logits.items()
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
