"""What the per-token service path adds to a decode step: client ITL p50 minus the worker's
decode forward time (`radixserve_forward_time_seconds{mode="decode"}` on its /metrics,
scraped before and after the run), for one or more checkouts in one run.

    python -m benchmarks.serving.token_path                       # this checkout
    python -m benchmarks.serving.token_path --trees . /tmp/rs-main   # vs a `git worktree`
    python -m benchmarks.serving.token_path --trees . /tmp/rs-main --tokenizer-cpu --rounds 5

Each tree serves the embedded model (bf16, CPU) in a fresh `radixserve serve` started
from that tree (the same interpreter; `python -m` imports the tree's code), and runs the
multi-turn workload at the given concurrency; trees alternate over `--rounds` so that a
machine that slows down mid-run does not favour one. The forward p50 is interpolated
within the histogram's buckets (Prometheus' `histogram_quantile`), so the mean (exact:
sum over count) is reported beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.serving import client
from benchmarks.serving.compare import COMMON_SERVER_FLAGS, DEFAULT_SERVER_ARGS
from benchmarks.serving.metrics import scrape_forward, summarize
from benchmarks.serving.server_peer import RadixServer
from benchmarks.serving.workloads import WorkloadConfig, build, warmup_prompt


@dataclass(frozen=True)
class PathCell:
    tree: str
    commit: str
    round: int
    itl_p50_ms: float
    forward_p50_ms: float
    forward_mean_ms: float
    decode_steps: int
    output_tok_s: float
    errors: dict[str, int]

    @property
    def path_ms(self) -> float:
        """Client ITL p50 minus the worker's decode forward p50."""
        return self.itl_p50_ms - self.forward_p50_ms


def commit_of(tree: Path) -> str:
    out = subprocess.run(
        ["git", "--no-optional-locks", "rev-parse", "--short", "HEAD"],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return out + ("+dirty" if dirty else "")


def run_tree(
    tree: Path, flags: list[str], cfg: WorkloadConfig, concurrency: int, round_: int
) -> PathCell:
    requests = build("multi-turn", cfg)
    with RadixServer(flags, cwd=tree) as server:
        worker_metrics = server.metrics_urls[1]
        server.flush_cache()
        before = scrape_forward(worker_metrics)
        result = asyncio.run(
            client.run(
                server.base_url,
                requests,
                [r.prompt for r in requests],
                concurrency=concurrency,
                metrics_urls=server.metrics_urls,
                warmup=[warmup_prompt(cfg)],
            )
        )
        delta = scrape_forward(worker_metrics) - before
    summary = summarize(result.results, result.duration_s)
    return PathCell(
        tree=str(tree),
        commit=commit_of(tree),
        round=round_,
        itl_p50_ms=summary.itl_ms.p50 or 0.0,
        forward_p50_ms=(delta.quantile(0.5) or 0.0) * 1000,
        forward_mean_ms=(delta.mean or 0.0) * 1000,
        decode_steps=int(delta.count),
        output_tok_s=summary.output_throughput,
        errors=summary.errors,
    )


def tokenizer_cpu_us(tree: Path, batch: int) -> float:
    """`tokenizer_cpu.py` run inside `tree` (its source, so a tree without it runs it too)."""
    source = (Path(__file__).parent / "tokenizer_cpu.py").read_text()
    out = subprocess.run(
        [sys.executable, "-c", source, "--batch", str(batch)],
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.token_path",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    parser.add_argument("--trees", nargs="+", type=Path, default=[Path(".")])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--server-args",
        default=f"{DEFAULT_SERVER_ARGS} --disable-overlap-schedule",
        help="extra `radixserve serve` flags (default: %(default)s)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the cells here")
    parser.add_argument(
        "--tokenizer-cpu",
        action="store_true",
        help="only the tokenizer side's CPU per step without HTTP (tokenizer_cpu.py), per tree",
    )
    WorkloadConfig().add_flags(parser)
    args = parser.parse_args()
    cfg = WorkloadConfig().from_flags(args)
    if args.tokenizer_cpu:
        for tree in args.trees:
            runs = [tokenizer_cpu_us(tree.resolve(), args.concurrency) for _ in range(args.rounds)]
            print(
                f"{commit_of(tree.resolve()):<16} ({tree}): tokenizer CPU per step at batch "
                f"{args.concurrency}: median {statistics.median(runs):.0f} us "
                f"(runs: {', '.join(f'{r:.0f}' for r in runs)})"
            )
        return
    flags = ["--model", "embedded", *COMMON_SERVER_FLAGS, *args.server_args.split()]
    cells: list[PathCell] = []
    for round_ in range(args.rounds):
        for tree in args.trees:
            cell = run_tree(tree.resolve(), flags, cfg, args.concurrency, round_)
            cells.append(cell)
            print(
                f"round {round_} {cell.commit:<16} ITL p50 {cell.itl_p50_ms:6.1f} ms  "
                f"forward p50 {cell.forward_p50_ms:6.1f} (mean {cell.forward_mean_ms:6.1f}, "
                f"{cell.decode_steps} steps)  path {cell.path_ms:6.1f} ms  "
                f"{cell.output_tok_s:6.1f} out tok/s  {cell.errors or ''}",
                flush=True,
            )
    print(f"\nmulti-turn, concurrency {args.concurrency}, medians over {args.rounds} round(s):")
    print("| tree | ITL p50 ms | decode forward p50 ms (mean) | ITL − forward ms | out tok/s |")
    print("|---|---|---|---|---|")
    for tree in args.trees:
        mine = [c for c in cells if c.tree == str(tree.resolve())]
        print(
            f"| {mine[0].commit} ({tree}) "
            f"| {statistics.median(c.itl_p50_ms for c in mine):.1f} "
            f"| {statistics.median(c.forward_p50_ms for c in mine):.1f} "
            f"({statistics.median(c.forward_mean_ms for c in mine):.1f}) "
            f"| {statistics.median(c.path_ms for c in mine):.1f} "
            f"| {statistics.median(c.output_tok_s for c in mine):.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(c) for c in cells], indent=1))


if __name__ == "__main__":
    main()
