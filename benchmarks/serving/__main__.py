"""Benchmark one running OpenAI-compatible server on one workload.

    python -m benchmarks.serving --base-url http://127.0.0.1:30000 --workload shared-prefix \
        --concurrency 8
    python -m benchmarks.serving --workload random --request-rate 2 --prompt-format text \
        --json out.json

Prints the summary (and writes it as JSON with `--json`). With `--prompt-format text` the
token-id prompts are decoded with `--tokenizer` and the server re-tokenizes them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path

from benchmarks.serving import client
from benchmarks.serving.metrics import LatencyStats, Summary, summarize
from benchmarks.serving.workloads import WORKLOADS, WorkloadConfig, build, warmup_prompt


def format_summary(s: Summary) -> str:
    def stats(name: str, st: LatencyStats) -> str:
        values = dataclasses.asdict(st)
        return f"{name:<10}" + "  ".join(
            f"{k} {'-' if v is None else f'{v:9.1f}'}" for k, v in values.items()
        )

    rate = "-" if s.radix_hit_rate is None else f"{s.radix_hit_rate:.1%}"
    cached = "-" if s.cached_prompt_fraction is None else f"{s.cached_prompt_fraction:.1%}"
    return "\n".join(
        [
            f"completed {s.completed}, failed {s.failed} {s.errors or ''}, {s.duration_s:.1f} s",
            f"requests/s {s.request_throughput:.2f}   output tok/s {s.output_throughput:.1f}   "
            f"total tok/s {s.total_throughput:.1f}",
            f"prompt tokens {s.prompt_tokens}, output tokens {s.output_tokens}; "
            f"cached (usage) {cached}, radix hit rate (/metrics) {rate}",
            "latency, ms:",
            stats("TTFT", s.ttft_ms),
            stats("ITL", s.itl_ms),
            stats("TPOT", s.tpot_ms),
            stats("E2E", s.e2e_ms),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument(
        "--model", default=None, help="default: the first of the server's /v1/models"
    )
    parser.add_argument("--workload", choices=list(WORKLOADS), default="shared-prefix")
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    load.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals per second (seeded)"
    )
    parser.add_argument("--prompt-format", choices=["ids", "text"], default="ids")
    parser.add_argument(
        "--tokenizer", default="embedded", help="decodes prompts for --prompt-format text"
    )
    parser.add_argument(
        "--metrics-url",
        action="append",
        default=None,
        help="Prometheus endpoints to read the prefix-cache counters from, first match wins "
        "(default: radixserve's worker /metrics if /get_server_info names it, then "
        "BASE_URL/metrics); repeatable",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    WorkloadConfig().add_flags(parser)
    args = parser.parse_args()

    cfg = WorkloadConfig().from_flags(args)
    requests = build(args.workload, cfg)
    prompts: list[list[int]] | list[str] = [r.prompt for r in requests]
    warmup: list[list[int]] | list[str] = [warmup_prompt(cfg)]
    if args.prompt_format == "text":
        from engine.model.tokenizer_cache import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        prompts, warmup = tokenizer.batch_decode(prompts), tokenizer.batch_decode(warmup)
    result = asyncio.run(
        client.run(
            args.base_url,
            requests,
            prompts,
            model=args.model,
            concurrency=args.concurrency,
            request_rate=args.request_rate,
            seed=cfg.seed,
            metrics_urls=args.metrics_url,
            warmup=warmup,
            timeout_s=args.timeout,
        )
    )
    summary = summarize(result.results, result.duration_s, result.radix_hit_rate)
    print(
        f"{args.workload}: {len(requests)} requests, concurrency {args.concurrency}, "
        f"rate {args.request_rate}"
    )
    print(format_summary(summary))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "workload": args.workload,
                    "config": dataclasses.asdict(cfg),
                    "summary": dataclasses.asdict(summary),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
