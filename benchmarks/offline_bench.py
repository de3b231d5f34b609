"""Offline throughput of the Engine on a shared-prefix workload, configurations side by side.

Workload (deterministic): `--requests` prompts = one shared `--prefix-len`-token block +
`--suffix-len` distinct tokens each; `--output-len` greedy tokens each (ignore_eos), all
submitted at once. Configurations: radix cache on/off × overlap loop on/off, each in a
fresh Engine after one warm-up request, in one run.

Run: .venv/bin/python benchmarks/offline_bench.py [--dtype bfloat16] [--requests 64]
Results are recorded in docs/benchmarks/offline.md.
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import torch

from engine.api import Engine

CONFIGS = {
    "radix on, overlap on": dict(disable_radix_cache=False, disable_overlap_schedule=False),
    "radix on, overlap off": dict(disable_radix_cache=False, disable_overlap_schedule=True),
    "radix off, overlap on": dict(disable_radix_cache=True, disable_overlap_schedule=False),
    "radix off, overlap off": dict(disable_radix_cache=True, disable_overlap_schedule=True),
}


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_len)]
    return [
        prefix + [rng.randrange(100, vocab) for _ in range(args.suffix_len)]
        for _ in range(args.requests)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=120_000)
    parser.add_argument("--schedule-policy", default="lpm")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; "
        f"model: {args.model or 'embedded SmolLM2-135M-Instruct'} in {args.dtype}"
    )
    print(
        f"workload: {args.requests} requests × ({args.prefix_len} shared + "
        f"{args.suffix_len} distinct) prompt tokens, {args.output_len} output tokens each; "
        f"schedule policy {args.schedule_policy}\n"
    )
    print(
        "| configuration | seconds | requests/s | output tok/s | total tok/s | prefilled tokens "
        "| cached tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    params = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
    reference: list[list[int]] | None = None
    for name in args.configs:
        engine = Engine(
            args.model,
            dtype=args.dtype,
            max_total_tokens=args.max_total_tokens,
            max_running_requests=max(args.requests, 8),
            schedule_policy=args.schedule_policy,
            **CONFIGS[name],
        )
        prompts = workload(args, engine.model_runner.model_config.vocab_size)
        engine.generate([[5, 6, 7, 8]], {"max_new_tokens": 2})  # warm-up
        stats = engine.scheduler.stats
        prefilled_before = stats.prefill_tokens
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        engine.shutdown()
        outputs = [r.output_ids for r in results]
        reference = reference or outputs
        same = sum(a == b for a, b in zip(outputs, reference))
        output_tokens = sum(len(o) for o in outputs)
        total_tokens = output_tokens + sum(len(p) for p in prompts)
        cached = sum(r.meta.cached_tokens for r in results)
        print(
            f"| {name} | {seconds:.1f} | {len(prompts) / seconds:.2f} | "
            f"{output_tokens / seconds:.0f} | {total_tokens / seconds:.0f} | "
            f"{stats.prefill_tokens - prefilled_before:,} | {cached:,} |"
            + (
                ""
                if same == len(outputs)
                else f" ({len(outputs) - same} outputs differ from the first row)"
            )
        )


if __name__ == "__main__":
    main()
