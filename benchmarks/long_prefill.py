"""The forward time of one long prompt's prefill in the CPU's chunks (a 2,048-token prompt
in 256-token chunks by default): what a dropped long prompt holds the worker for, and the
bulk of its TTFT. Works on older checkouts too (no option newer than `dtype` is needed;
`testing/` comes from this checkout, after the old one on PYTHONPATH), so that a
`git worktree` of an earlier commit runs it side by side (docs/benchmarks/cpu-paths.md).

    python -m benchmarks.long_prefill --dtype float32 --quantization gguf
    cd /tmp/base && PYTHONPATH=.:/work/main \
        python /work/main/benchmarks/long_prefill.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.model.runner import ModelRunner
from testing.batches import ExtendInput, build_forward_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", help="omit on checkouts that predate the option")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args()
    options = {} if args.quantization is None else {"quantization": args.quantization}
    runner = ModelRunner(
        "embedded",
        dtype=args.dtype,
        max_total_tokens=2 * args.tokens,
        max_running_requests=4,
        **options,
    )
    ids = torch.randint(100, 40000, (args.tokens,), generator=torch.Generator().manual_seed(0))

    def prefill() -> float:
        (row,) = runner.req_to_token_pool.alloc(1)
        start = time.perf_counter()
        for begin in range(0, args.tokens, args.chunk):
            chunk = ids[begin : begin + args.chunk].tolist()
            runner.forward(build_forward_batch(runner, [ExtendInput(row, begin, chunk)]))
        elapsed = time.perf_counter() - start
        slots = runner.req_to_token_pool.req_to_token[row, : args.tokens].long()
        runner.token_to_kv_pool_allocator.free(slots)
        runner.req_to_token_pool.free([row])
        return elapsed

    prefill()  # warm-up
    best = min(prefill() for _ in range(2))
    print(
        f"{args.dtype} {options}: {args.tokens}-token prefill {best:.2f} s "
        f"({args.tokens / best:.0f} tok/s), aten {torch.backends.cpu.get_cpu_capability()}"
    )


if __name__ == "__main__":
    main()
