"""The serving benchmark's whole peer matrix in one run: every peer on every workload at each
concurrency, then one decode cell per peer (batch 32, 512-token contexts, against the
memory-bandwidth ceiling). Writes `<out>/results.json`, `<out>/*.png` and `<out>.md`.

    python -m benchmarks.serving.compare                          # about 20 minutes on 2 cores
    python -m benchmarks.serving.compare --smoke --out /tmp/serving-smoke
    python -m benchmarks.serving.compare --decode-only --peers rs-overlap-off hf-bf16
    python -m benchmarks.serving.compare --report-only docs/benchmarks/serving/results.json

Peers run one after the other (never two at once: they would share the cores), each
radixserve peer in a fresh server, each cell after a cache flush so that no cell inherits
the previous one's prefixes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import torch

from benchmarks.serving import client, report
from benchmarks.serving.client import RunResult
from benchmarks.serving.decode_ceiling import DEFAULT_BANDWIDTH_GBS, ceiling
from benchmarks.serving.hf_peer import HFGeneratePeer
from benchmarks.serving.llama_peer import DEFAULT_FLAGS as LLAMA_FLAGS
from benchmarks.serving.llama_peer import LlamaServer, default_binary, thread_flags
from benchmarks.serving.metrics import forward_summary, scrape_forward, summarize
from benchmarks.serving.server_peer import RadixServer, ServerPeer
from benchmarks.serving.workloads import (
    WORKLOADS,
    BenchRequest,
    WorkloadConfig,
    build,
    fixed_length,
    warmup_prompt,
)

COMMON_SERVER_FLAGS = ("--model", "embedded", "--dtype", "bfloat16", "--heartbeat-interval", "20")
"""`--heartbeat-interval 20`: the worker heartbeats from its scheduler loop, so a prefill
of ~16k tokens on two cores (10 s and more) silences it past the default 3 x 1 s, and the
tokenizer then fails every request in flight."""
DEFAULT_SERVER_ARGS = "--schedule-policy lpm"
"""lpm is the cache-aware order RadixAttention is designed with (longest hit first, and
in-batch dedup of shared prefixes); with the radix cache off it falls back to fcfs."""

SERVER_PEERS = {
    "rs-all-on": ServerPeer("radix cache on, overlap loop on", ("--no-disable-overlap-schedule",)),
    "rs-overlap-off": ServerPeer(
        "radix cache on, normal loop (the CPU default)", ("--disable-overlap-schedule",)
    ),
    "rs-radix-off": ServerPeer(
        "radix cache off, normal loop", ("--disable-radix-cache", "--disable-overlap-schedule")
    ),
}
HF_PEERS = {"hf-bf16": "bfloat16", "hf-fp32": "float32"}
LLAMA_PEER = "llama-server"
"""llama.cpp's server on the same GGUF (`llama_peer.py`); needs `--llama-server PATH`."""
PEERS = [*HF_PEERS, *SERVER_PEERS, LLAMA_PEER]
SMOKE = WorkloadConfig(
    requests=4,
    output_len=4,
    groups=2,
    system_len=32,
    question_len=8,
    turns=2,
    user_len=16,
    shots=2,
    shot_len=16,
    random_len=48,
)


DEFAULT_LLAMA_SERVER = default_binary()


class Runner(Protocol):
    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult: ...


class ServerRunner:
    """Also reads the worker's decode forward time over each cell (`forward`), so the report
    can say what the per-token path adds: client ITL p50 minus the forward p50."""

    def __init__(self, server: RadixServer, warmup: list[int]):
        self.server = server
        self.warmup = warmup
        self.forward: dict[str, float | None] | None = None

    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        self.server.flush_cache()
        worker_metrics = self.server.metrics_urls[1]
        before = scrape_forward(worker_metrics)
        result = self._run(requests, concurrency)
        delta = scrape_forward(worker_metrics) - before
        self.forward = forward_summary(delta)
        return result

    def _run(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        return asyncio.run(
            client.run(
                self.server.base_url,
                requests,
                [r.prompt for r in requests],
                concurrency=concurrency,
                metrics_urls=self.server.metrics_urls,
                warmup=[self.warmup],
            )
        )


class HFRunner:
    def __init__(self, dtype: str, device: str, warmup: list[int]):
        self.peer = HFGeneratePeer.embedded(dtype, device)
        self.peer.run_batch([BenchRequest(warmup, 4)])

    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        results, duration = self.peer.run(requests, concurrency)
        return RunResult(results, duration, None)


class LlamaRunner:
    """A fresh llama-server per cell: it has no cache flush."""

    def __init__(self, binary: Path, warmup: list[int]):
        self.binary = binary
        self.warmup = warmup

    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        with LlamaServer(self.binary) as server:
            return asyncio.run(
                client.run(
                    server.base_url,
                    requests,
                    [r.prompt for r in requests],
                    concurrency=concurrency,
                    metrics_urls=[],
                    warmup=[self.warmup],
                )
            )


@contextmanager
def open_peer(
    name: str,
    server_args: list[str],
    warmup: list[int],
    hf_device: str,
    llama_server: Path = DEFAULT_LLAMA_SERVER,
) -> Iterator[Runner]:
    if name in HF_PEERS:
        yield HFRunner(HF_PEERS[name], hf_device, warmup)
        return
    if name == LLAMA_PEER:
        yield LlamaRunner(llama_server, warmup)
        return
    with RadixServer([*COMMON_SERVER_FLAGS, *server_args, *SERVER_PEERS[name].flags]) as server:
        print(f"  server log: {server.log_path}", flush=True)
        yield ServerRunner(server, warmup)


def peer_descriptions(server_args: list[str], hf_device: str) -> dict[str, str]:
    described = {
        name: f"transformers `generate`, static batches, {dtype} on {hf_device}"
        for name, dtype in HF_PEERS.items()
    }
    described[LLAMA_PEER] = (
        "llama.cpp `llama-server`, the same GGUF (Q4_1) on CPU "
        f"(`llama-server -m <gguf> {shlex.join([*LLAMA_FLAGS, *thread_flags()])}`), "
        "a fresh server per cell"
    )
    for name, peer in SERVER_PEERS.items():
        flags = shlex.join([*COMMON_SERVER_FLAGS, *server_args, *peer.flags])
        described[name] = f"radixserve: {peer.name} (`radixserve serve {flags}`)"
    return described


def cell_record(
    peer: str,
    repeat: int,
    workload: str,
    concurrency: int,
    result: RunResult,
    forward: dict[str, float | None] | None = None,
) -> dict[str, Any]:
    summary = summarize(result.results, result.duration_s, result.radix_hit_rate)
    extra = {} if forward is None else {"decode_forward_ms": forward}
    return {
        **extra,
        "peer": peer,
        "repeat": repeat,
        "workload": workload,
        "concurrency": concurrency,
        "summary": dataclasses.asdict(summary),
        "ttft_ms": [
            r.ttft * 1000 for r in result.results if r.error is None and r.ttft is not None
        ],
    }


def run_matrix(
    args: argparse.Namespace, cfg: WorkloadConfig, record: dict[str, Any], json_path: Path
) -> None:
    cells = (
        []
        if args.decode_only
        else [(w, c, build(w, cfg)) for w in args.workloads for c in args.concurrency]
    )
    cells.append(
        ("decode", args.decode_batch, fixed_length(cfg, args.decode_batch, args.decode_context))
    )
    server_args = shlex.split(args.server_args)
    start = time.perf_counter()
    for repeat in range(args.repeat):
        for peer in args.peers:
            print(
                f"[{time.perf_counter() - start:6.0f} s] {peer} (round {repeat + 1}/{args.repeat})",
                flush=True,
            )
            with open_peer(
                peer, server_args, warmup_prompt(cfg), args.hf_device, args.llama_server
            ) as runner:
                for workload, concurrency, requests in cells:
                    result = runner.run(requests, concurrency)
                    forward = runner.forward if isinstance(runner, ServerRunner) else None
                    entry = cell_record(peer, repeat, workload, concurrency, result, forward)
                    record["results"].append(entry)
                    json_path.write_text(json.dumps(record, indent=1))
                    s = entry["summary"]
                    print(
                        f"[{time.perf_counter() - start:6.0f} s]   {workload:<13} "
                        f"c={concurrency:<3} {s['output_throughput']:7.1f} out tok/s  "
                        f"TTFT p50 {s['ttft_ms']['p50'] or 0:8.0f} ms  "
                        f"ITL p50 {s['itl_ms']['p50'] or 0:6.0f} ms  {s['errors'] or ''}",
                        flush=True,
                    )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.compare",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    parser.add_argument(
        "--peers",
        nargs="+",
        choices=PEERS,
        default=None,
        help="default: all of them (llama-server only when its binary is there)",
    )
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[8, 32])
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds over all peers, for noise margins"
    )
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument(
        "--decode-only", action="store_true", help="only the decode cell of each peer"
    )
    parser.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=DEFAULT_BANDWIDTH_GBS,
        help="memory bandwidth for the decode ceiling",
    )
    parser.add_argument(
        "--hf-device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device of the transformers peers; radixserve picks its own (default: %(default)s)",
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=DEFAULT_LLAMA_SERVER,
        metavar="PATH",
        help="llama.cpp's llama-server binary for the llama-server peer (default: %(default)s)",
    )
    parser.add_argument(
        "--server-args",
        default=DEFAULT_SERVER_ARGS,
        help="extra `radixserve serve` flags for every radixserve peer, written with `=` as in "
        "--server-args='--schedule-policy fcfs' (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("docs/benchmarks/serving"),
        help="folder for results.json and plots; the markdown goes to OUT.md",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes (4 requests, 4 tokens, concurrency 2 and 4, decode 4 x 32): checks the "
        "plumbing in a few minutes, measures nothing",
    )
    parser.add_argument(
        "--report-only",
        type=Path,
        default=None,
        metavar="JSON",
        help="rewrite the markdown and plots from an earlier results.json, run nothing",
    )
    WorkloadConfig().add_flags(parser)
    args = parser.parse_args()
    if args.report_only:
        args.out.mkdir(parents=True, exist_ok=True)
        report.write(json.loads(args.report_only.read_text()), args.out)
        return
    if args.peers is None:
        args.peers = [p for p in PEERS if p != LLAMA_PEER or os.access(args.llama_server, os.X_OK)]
        if LLAMA_PEER not in args.peers:
            print(f"no llama-server at {args.llama_server}: that peer is left out", flush=True)
    cfg = WorkloadConfig().from_flags(args)
    if args.smoke:
        cfg = dataclasses.replace(SMOKE, seed=cfg.seed)
        args.concurrency, args.decode_batch, args.decode_context = [2, 4], 4, 32
    signal.signal(
        signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum)
    )  # stop servers on the way out

    from engine.model.loader import open_checkpoint

    decode_context = args.decode_context + cfg.output_len // 2  # mean context over the decode
    bound = ceiling(
        open_checkpoint("embedded").config,
        args.decode_batch,
        decode_context,
        bandwidth_gbs=args.bandwidth_gbs,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "results.json"
    record: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "benchmarks.serving.compare", *sys.argv[1:]]),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": report.machine_info(),
        "workload_config": dataclasses.asdict(cfg),
        "workloads": [] if args.decode_only else args.workloads,
        "concurrency": args.concurrency,
        "peers": {
            name: desc
            for name, desc in peer_descriptions(
                shlex.split(args.server_args), args.hf_device
            ).items()
            if name in args.peers
        },
        "decode": {
            "batch": args.decode_batch,
            "context": args.decode_context,
            "mean_context": decode_context,
            "ceiling": {
                **dataclasses.asdict(bound),
                "step_ms": bound.step_ms,
                "tokens_per_s": bound.tokens_per_s,
            },
        },
        "results": [],
    }
    start = time.perf_counter()
    run_matrix(args, cfg, record, json_path)
    record["duration_s"] = time.perf_counter() - start
    record["machine"]["load_average_end"] = report.load_average()
    json_path.write_text(json.dumps(record, indent=1))
    report.write(record, args.out)
    print(f"done in {record['duration_s'] / 60:.1f} min: {json_path}, {args.out}.md")


if __name__ == "__main__":
    main()
