"""Fan-out from a shared prefix longer than the sliding window, the hole vLLM (#48435) and
SGLang leave in prefix caching for hybrid models: once the prefix's sliding-window KV is
freed, every new request re-prefills it. Window checkpoints keep the window before each
branch point in the radix tree, so that from the third request on the prefix hits.

One server per configuration, the same requests to each through `/v1/completions`: a
shared prefix of `--prefix-len` random tokens, then each request's own `--question-len`
tokens, `--requests` of them at `--concurrency`. Per request: the share of the shared
prefix served from the cache (`usage.prompt_tokens_details.cached_tokens`) and the TTFT.
Results: docs/benchmarks/gemma3.md.

    flock /tmp/rs-cpu.lock .venv/bin/python -m benchmarks.swa_fanout \\
        --out docs/benchmarks/gemma3/fanout.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from pathlib import Path
from typing import Any

from benchmarks.serving.client import run
from benchmarks.serving.metrics import RequestResult
from benchmarks.serving.server_peer import RadixServer
from benchmarks.serving.workloads import FIRST_TOKEN_ID, BenchRequest

CONFIGS = {
    "checkpoints": (),
    "no-checkpoints": ("--disable-window-checkpoints",),
    "no-radix-cache": ("--disable-radix-cache",),
}
"""What each server runs with, besides the model: the default; the anchors' design, which
keeps only the window before each cached sequence's end; no prefix cache at all."""


def fan_out(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]

    prefix = tokens(args.prefix_len)
    return [
        BenchRequest(prefix + tokens(args.question_len), args.output_len)
        for _ in range(args.requests)
    ]


def summary(results: list[RequestResult], prefix_len: int) -> dict[str, Any]:
    """The cached share of the shared prefix per request, in the order sent; how many fall
    below 0.9 (the fan-out's first request and the first to branch off may recompute it:
    requests sent together reach the scheduler in any order, so it is a count, not the
    first two sent), and TTFT percentiles."""
    failed = [r.error for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {sorted(set(failed))}")
    shares = [min(r.cached_tokens or 0, prefix_len) / prefix_len for r in results]
    ttfts = sorted(r.ttft for r in results if r.ttft is not None)
    return {
        "cached_share": [round(s, 3) for s in shares],
        "below_0_9": sum(s < 0.9 for s in shares),
        "mean_share": round(statistics.fmean(shares), 3),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 4),
    }


def run_config(name: str, args: argparse.Namespace, requests: list[BenchRequest]) -> dict[str, Any]:
    flags = ["--model", args.model, *CONFIGS[name], *args.server_flags]
    warmup = [[FIRST_TOKEN_ID + 7] * 16]  # shares no prefix with the workload
    with RadixServer(flags) as server:
        result = asyncio.run(
            run(
                server.base_url,
                requests,
                [r.prompt for r in requests],
                concurrency=args.concurrency,
                warmup=warmup,
                timeout_s=1800.0,
            )
        )
    out = summary(result.results, args.prefix_len)
    out["duration_s"] = round(result.duration_s, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--vocab-size", type=int, default=262144)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument(
        "--server-flags", nargs=argparse.REMAINDER, default=[], help="passed to every server"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    requests = fan_out(args, args.vocab_size)
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "out"}}
    for name in args.configs:
        report[name] = run_config(name, args, requests)
        print(name, json.dumps({k: v for k, v in report[name].items() if k != "cached_share"}))
    if "no-radix-cache" in report:
        base = report["no-radix-cache"]["ttft_p50_s"]
        for name in args.configs:
            report[name]["ttft_p50_vs_no_radix_cache"] = round(report[name]["ttft_p50_s"] / base, 3)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "args"}, indent=1))


if __name__ == "__main__":
    main()
