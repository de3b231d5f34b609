"""The comparison's record rendered for people: `<out>.md` (command, machine, method,
tables, the target ratios) and the plots in `<out>/` (`plots.py`). Everything is
computed from the JSON record, so `compare --report-only` can redo it without rerunning
anything."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from collections import defaultdict
from collections.abc import Callable, Iterable
from importlib.metadata import version
from itertools import product
from pathlib import Path
from typing import Any

from benchmarks.serving.record import grouped, median

NOTES_MARKER = "<!-- Notes below this line are kept when compare.py rewrites this file. -->"
REPO_ROOT = Path(__file__).resolve().parents[2]
HF_REFERENCE = "hf-bf16"
LLAMA_SERVER = "llama-server"
VLLM_CPU = "vllm-cpu"
RADIX_OFF = "rs-radix-off"
OVERLAP_ON, OVERLAP_OFF = "rs-all-on", "rs-overlap-off"
RADIX_ON_PEERS = (OVERLAP_ON, OVERLAP_OFF)
THREAD_ENV = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "MKL_NUM_THREADS",
    "KMP_BLOCKTIME",
)
"""Variables that change how torch's CPU threads behave: recorded, since on a busy two-core
machine they move small ops from microseconds to milliseconds."""
ISA_ENV = ("RADIXSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
"""Variables that force lower kernel paths (radixserve's, PyTorch's, oneDNN's)."""

METHOD = """\
- Client (`benchmarks/serving/client.py`): streaming `/v1/completions` with token-id
  prompts, greedy, `max_tokens` = the workload's output length and `ignore_eos`, so every
  peer generates the same number of tokens; at most *c* requests in flight (closed loop),
  all due at the start. A request's clock starts when it is sent. TTFT: to the first chunk
  with text; ITL: gaps between chunks with text; TPOT: (end-to-end - TTFT) / (tokens - 1);
  tokens counted from the closing usage chunk. Throughputs count completed requests over
  the whole run's wall time. "cached" is the prompt tokens the server reported as cached
  (`usage.prompt_tokens_details.cached_tokens`); "radix hit" is the delta of
  `radixserve_prefix_cache_{hit,query}_tokens_total` on /metrics over the run (`-` where
  the server does not export them).
- transformers `generate` (`benchmarks/serving/hf_peer.py`): the same weights (the embedded
  GGUF as radixserve's loader dequantizes it) in `LlamaForCausalLM`, SDPA, greedy, no EOS
  stop; the workload in order, in left-padded static batches of *c* (cut early where a
  multi-turn request depends on one in the batch), one batch after the other. Every request
  of a batch counts as sent when the batch starts: TTFT is the batch's prefill, ITLs are its
  decode steps. No HTTP, no tokenizer, no scheduler: what a server adds has to pay for itself.
- radixserve peers: a fresh `radixserve serve` per peer, `/flush_cache` before every cell
  and one short unrelated warm-up request; client and server share the machine's cores.
  Each peer's kernel path (`cpu_isa` in `/get_server_info`), dtype and weight format (the
  `radixserve_cpu_info` gauge) are read from the running server.
- llama.cpp's `llama-server` (`benchmarks/serving/llama_peer.py`): a fresh server per cell
  (it has no cache flush), the same warm-up request.
- vLLM's CPU build (`benchmarks/serving/vllm_peer.py`): one server per peer (a start takes
  about a minute), `/reset_prefix_cache` before every cell, the same warm-up request.
- Decode: *batch* unique prompts of *context* tokens at concurrency *batch*; decode tokens/s
  = batch / ITL p50 (the steady-state step time; TPOT also counts the waits while other
  requests of the wave prefill, and ITL would undercount if chunks carried several tokens:
  read the two side by side). Ceiling: one step reads every weight and every request's KV
  once (`benchmarks/serving/decode_ceiling.py`), at the mean context over the decode, over
  the bandwidth given."""


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cpuinfo_field(cpuinfo: str, name: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def _git(*args: str) -> str:
    """Read-only git (`--no-optional-locks`: never takes the index lock others may hold)."""
    try:
        return subprocess.run(
            ["git", "--no-optional-locks", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict[str, Any]:
    import torch

    from engine.kernels.cpu.isa import ISA_FLAGS

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    all_flags = _cpuinfo_field(cpuinfo, "flags").split()
    flags = set(all_flags)
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    mem_kib = _cpuinfo_field(meminfo, "MemTotal").split()
    return {
        "cpu": _cpuinfo_field(cpuinfo, "model name") or platform.processor(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "amx_bf16": "amx_bf16" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "isa_flags": [name for name in ISA_FLAGS if name in flags],
        "cpu_flags": all_flags,
        "isa_env": {name: os.environ[name] for name in ISA_ENV if name in os.environ},
        "memory_gib": round(int(mem_kib[0]) / 2**20, 1) if mem_kib else None,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "thread_env": {name: os.environ[name] for name in THREAD_ENV if name in os.environ},
        "transformers": version("transformers"),
        "python": platform.python_version(),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "load_average_start": load_average(),
    }


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def _spread(entries: list[dict[str, Any]], key: str) -> str:
    """Median over repeats, with min-max when there was more than one."""
    values = [e["summary"][key] for e in entries]
    text = _fmt(statistics.median(values), ".1f")
    return text if len(values) == 1 else f"{text} ({min(values):.1f}-{max(values):.1f})"


def _latency(entries: list[dict[str, Any]], key: str, *ps: str) -> str:
    return " / ".join(_fmt(median(entries, lambda s, p=p: s[key][p])) for p in ps)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _errors(entries: list[dict[str, Any]]) -> str:
    merged: dict[str, int] = defaultdict(int)
    for e in entries:
        for kind, n in e["summary"]["errors"].items():
            merged[kind] += n
    return ", ".join(f"{kind} {n}" for kind, n in merged.items()) or "0"


def workload_table(record: dict[str, Any], workload: str) -> list[str]:
    cells = grouped(record)
    lines = [
        "| c | peer | req/s | out tok/s | total tok/s | TTFT p50 / p90 / p99 ms | "
        "ITL p50 / p99 ms | TPOT p50 ms | E2E p50 / p99 ms | cached | radix hit | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in record["concurrency"]:
        for peer in record["peers"]:
            if not (entries := cells.get((peer, workload, c))):
                continue
            cached = median(entries, lambda s: s["cached_prompt_fraction"])
            radix_hit = median(entries, lambda s: s["radix_hit_rate"])
            lines.append(
                f"| {c} | {peer} | {_spread(entries, 'request_throughput')} | "
                f"{_spread(entries, 'output_throughput')} | "
                f"{_spread(entries, 'total_throughput')} | "
                f"{_latency(entries, 'ttft_ms', 'p50', 'p90', 'p99')} | "
                f"{_latency(entries, 'itl_ms', 'p50', 'p99')} | "
                f"{_latency(entries, 'tpot_ms', 'p50')} | "
                f"{_latency(entries, 'e2e_ms', 'p50', 'p99')} | "
                f"{_percent(cached)} | {_percent(radix_hit)} | {_errors(entries)} |"
            )
    return lines


def decode_rates(record: dict[str, Any]) -> dict[str, float]:
    """Decode tokens/s per peer: batch over the median inter-token gap."""
    if not record.get("decode"):
        return {}
    batch = record["decode"]["batch"]
    rates = {}
    for (peer, workload, _), entries in grouped(record).items():
        itl = median(entries, lambda s: s["itl_ms"]["p50"])
        if workload == "decode" and itl:
            rates[peer] = batch / itl * 1000
    return rates


def decode_table(record: dict[str, Any]) -> list[str]:
    decode, bound = record["decode"], record["decode"]["ceiling"]
    rates = decode_rates(record)
    reference = rates.get(HF_REFERENCE)
    cells = grouped(record)
    lines = [
        f"Ceiling: {bound['weight_bytes'] / 1e6:.0f} MB of weights + "
        f"{bound['kv_bytes'] / 1e6:.0f} MB of KV per step "
        f"(batch {decode['batch']}, mean context {decode['mean_context']}, bf16) "
        f"at {bound['bandwidth_gbs']:g} GB/s "
        f"= {bound['step_ms']:.1f} ms/step, **{bound['tokens_per_s']:,.0f} tokens/s**.",
        "",
        "| peer | ITL p50 ms (step) | TPOT p50 ms | decode tok/s | of the ceiling | "
        f"vs {HF_REFERENCE} | TTFT p50 ms (prefill) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for peer in record["peers"]:
        if peer not in rates:
            continue
        entries = cells[peer, "decode", decode["batch"]]
        lines.append(
            f"| {peer} | {_latency(entries, 'itl_ms', 'p50')} | "
            f"{_latency(entries, 'tpot_ms', 'p50')} | {rates[peer]:.0f} | "
            f"{rates[peer] / bound['tokens_per_s']:.0%} | {_ratio(rates[peer], reference)} | "
            f"{_latency(entries, 'ttft_ms', 'p50')} |"
        )
    return lines


def path_table(record: dict[str, Any]) -> list[str]:
    """Per radixserve cell: client ITL p50 beside the worker's decode forward time over the
    same cell; their difference is what the per-token path (scheduler turn, detokenizer,
    tokenizer, SSE, client) adds to a step."""
    lines = [
        "| workload | c | peer | ITL p50 ms | decode forward p50 ms (mean) | ITL - forward ms |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for (peer, workload, c), entries in grouped(record).items():
        forwards = [e["decode_forward_ms"] for e in entries if e.get("decode_forward_ms")]
        itl = median(entries, lambda s: s["itl_ms"]["p50"])
        p50s = [f["p50"] for f in forwards if f["p50"] is not None]
        means = [f["mean"] for f in forwards if f["mean"] is not None]
        if not p50s or itl is None:
            continue
        p50 = statistics.median(p50s)
        lines.append(
            f"| {workload} | {c} | {peer} | {itl:.1f} | {p50:.1f} "
            f"({statistics.median(means):.1f}) | {itl - p50:.1f} |"
        )
    return lines if len(lines) > 2 else []


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def base_peer(label: str) -> tuple[str, str]:
    """A peer label split into the peer and its kernel-path suffix: `rs-all-on@avx2` ->
    (`rs-all-on`, `@avx2`)."""
    peer, at, path = label.partition("@")
    return peer, at + path


def same_path_peers(record: dict[str, Any], other: str, path: str) -> list[str]:
    """The peers a radixserve peer on kernel path `path` ("@avx2", or "") is set against for
    a target naming `other`: rs-radix-off on the same path; a peer built for the same path
    (llama-server@avx2) beside the peer itself, where the run has one."""
    if other == RADIX_OFF:
        return [other + path]
    return [other, *([other + path] if path and other + path in record["peers"] else [])]


TARGETS = [
    ("single-stream out tok/s", "single-stream", LLAMA_SERVER, "out", ">= 1x"),
    ("single-stream out tok/s", "single-stream", VLLM_CPU, "out", ">= 2x"),
    ("shared-prefix out tok/s", "shared-prefix", HF_REFERENCE, "out", ">= 3x"),
    ("shared-prefix out tok/s", "shared-prefix", LLAMA_SERVER, "out", ">= 3x"),
    ("shared-prefix out tok/s", "shared-prefix", VLLM_CPU, "out", ">= 3x"),
    ("shared-prefix out tok/s", "shared-prefix", RADIX_OFF, "out", ">= 2x"),
    ("shared-prefix TTFT p50", "shared-prefix", RADIX_OFF, "ttft", "<= 0.33x"),
    ("random out tok/s", "random", RADIX_OFF, "out", ">= 1x"),
    ("multi-turn out tok/s", "multi-turn", HF_REFERENCE, "out", ">= 2x"),
    ("multi-turn out tok/s", "multi-turn", LLAMA_SERVER, "out", ">= 1.5x"),
    ("multi-turn out tok/s", "multi-turn", VLLM_CPU, "out", ">= 2x"),
]
"""(figure, workload, the other peer, "out" (output tok/s) or "ttft" (TTFT p50), goal). A
radixserve peer on a forced kernel path is set against `rs-radix-off` on the same path."""


def target_rows(record: dict[str, Any]) -> Iterable[str]:
    """The serving targets (e.g. shared-prefix output >= 3x transformers') as ratios between
    peers of this run, for each radix-on peer (on each kernel path run)."""
    cells = grouped(record)
    figures: dict[str, Callable[[dict[str, Any]], float | None]] = {
        "out": lambda s: s["output_throughput"],
        "ttft": lambda s: s["ttft_ms"]["p50"],
    }

    def figure(peer: str, workload: str, c: int, kind: str) -> float | None:
        entries = cells.get((peer, workload, c))
        return median(entries, figures[kind]) if entries else None

    rates = decode_rates(record)
    for peer in record["peers"]:
        base, path = base_peer(peer)
        if base not in RADIX_ON_PEERS:
            continue
        for what, workload, named, kind, goal in TARGETS:
            for other, c in product(same_path_peers(record, named, path), record["concurrency"]):
                ours, theirs = figure(peer, workload, c, kind), figure(other, workload, c, kind)
                if ours is not None and theirs:
                    ratio, bound = ours / theirs, float(goal.split()[1].rstrip("x"))
                    met = ratio >= bound if goal.startswith(">=") else ratio <= bound
                    yield (
                        f"| {what} | {peer} vs {other} | {c} | {ratio:.2f}x | {goal} | "
                        f"{'yes' if met else 'no'} |"
                    )
        if peer in rates and HF_REFERENCE in rates:
            ratio = rates[peer] / rates[HF_REFERENCE]
            yield (
                f"| decode tok/s, batch {record['decode']['batch']} | {peer} vs {HF_REFERENCE} | "
                f"{record['decode']['batch']} | {ratio:.2f}x | >= 2x (aim) | "
                f"{'yes' if ratio >= 2 else 'no'} |"
            )
    for peer in record["peers"]:
        base, path = base_peer(peer)
        if base != OVERLAP_ON:
            continue
        on_peer, off_peer = peer, OVERLAP_OFF + path
        for workload in record["workloads"]:
            for c in record["concurrency"]:
                on, off = figure(on_peer, workload, c, "out"), figure(off_peer, workload, c, "out")
                if on is not None and off:
                    yield (
                        f"| {workload} out tok/s | {on_peer} vs {off_peer} (overlap loop) | "
                        f"{c} | {on / off:.2f}x | - | - |"
                    )


def kernel_lines(kernels: dict[str, dict[str, Any]]) -> list[str]:
    """What each radixserve peer ran as, read from its server."""
    if not kernels:
        return []
    lines = [
        "",
        "radixserve's kernel path, dtype, weights and KV cache, as each server reported them:",
        "",
        "| peer | kernel path | RADIXSERVE_CPU_ISA | dtype | weights | KV cache | settings |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, k in kernels.items():
        lines.append(
            f"| {label} | {k.get('cpu_isa') or '-'} | {k.get('RADIXSERVE_CPU_ISA') or '-'} | "
            f"{k.get('dtype') or '-'} | {k.get('weights') or '-'} | "
            f"{k.get('kv_cache_dtype') or '-'} | "
            f"`--dtype {k.get('dtype_setting')} --quantization {k.get('quantization_setting')}` |"
        )
    return lines


def vllm_kernel_lines(libraries: dict[str, list[str]]) -> list[str]:
    """Which of its wheel's kernel builds each vLLM peer ran (absent from older records)."""
    if not libraries:
        return []
    listed = "; ".join(
        f"{label}: {', '.join(f'`{lib}`' for lib in libs) or 'none found'}"
        for label, libs in libraries.items()
    )
    return ["", f"vLLM's kernel libraries, as each server's processes mapped them: {listed}."]


def stream_lines(cfg: dict[str, Any]) -> list[str]:
    """The concurrency-1 workloads (absent from records made before them)."""
    if "stream_requests" not in cfg:
        return []
    return [
        f"- `single-stream` (concurrency 1): {cfg['stream_requests']} unique prompts of "
        f"{cfg['stream_prompt_len']} tokens, {cfg['stream_output_len']} output tokens each, "
        "one after the other.",
        f"- `long-prompt` (concurrency 1): {cfg['long_prompt_repeats']} unique prompts of "
        f"{cfg['long_prompt_len']} tokens, 1 output token each: TTFT is the prefill.",
    ]


def markdown(record: dict[str, Any], plots_dir: str | None, notes: str) -> str:
    """The report; its plots section links `plots_dir`'s images (None: they were not drawn)."""
    lines = [
        *header_lines(record, plots_dir),
        "## Peers",
        "",
        *(f"- `{name}`: {desc}" for name, desc in record["peers"].items()),
        *kernel_lines(record.get("kernels") or {}),
        *vllm_kernel_lines(record.get("vllm_kernels") or {}),
        "",
        *workload_lines(record["workload_config"]),
        "",
        "## Method",
        "",
        METHOD,
        "",
        *result_lines(record, plots_dir),
    ]
    return "\n".join([*lines, "", NOTES_MARKER, notes.rstrip("\n"), ""]).rstrip("\n") + "\n"


def header_lines(record: dict[str, Any], plots_dir: str | None) -> list[str]:
    """The title, the command that made the report, and the machine it ran on."""
    m = record["machine"]
    isa = ", ".join(name for name in ("amx_bf16", "avx512_bf16") if m.get(name)) or "neither"
    isa_env = ", ".join(f"{k}={v}" for k, v in m.get("isa_env", {}).items()) or "none set"
    thread_env = (
        ", ".join(f"{k}={v}" for k, v in m.get("thread_env", {}).items())
        or "no OMP/MKL variables set"
    )
    duration = f"{record['duration_s'] / 60:.1f} min" if "duration_s" in record else "unfinished"
    gpu = f"; GPU {m['gpu']}" if m.get("gpu") else ""
    return [
        "# Serving benchmark: radixserve beside transformers `generate`, llama.cpp's server "
        "and vLLM's CPU build",
        "",
        f"Generated by `benchmarks/serving/compare.py` ({duration}, started "
        f"{record['started']}); rerun the command to refresh it. Raw figures: "
        f"[`{plots_dir}/results.json`]({plots_dir}/results.json).",
        "",
        "```bash",
        record["command"],
        "```",
        "",
        f"Machine: {m['cpu']}, {m['usable_cpus']} usable of {m['logical_cpus']} logical CPUs "
        f"({isa}), {m['memory_gib']} GiB{gpu}; torch {m['torch']} with {m['torch_threads']} "
        f"threads ({thread_env}), transformers "
        f"{m['transformers']}, Python {m['python']}; commit {m['git_commit']}"
        f"{' + local changes' if m['git_dirty'] else ''}. "
        f"Load average at the start {m['load_average_start']}, at the end "
        f"{m.get('load_average_end', '-')}: anything above ~0.5 means other jobs shared the "
        "cores, and single figures move by tens of percent; read ratios within one run.",
        "",
        f"CPU instruction sets (/proc/cpuinfo): {' '.join(m.get('isa_flags', [])) or '-'}; "
        f"kernel-path variables in the environment: {isa_env}.",
        "",
    ]


def workload_lines(cfg: dict[str, Any]) -> list[str]:
    """The workloads section, from the record's workload config."""
    return [
        "## Workloads (`benchmarks/serving/workloads.py`, seed "
        f"{cfg['seed']}, {cfg['output_len']} output tokens per request)",
        "",
        f"- `shared-prefix`: {cfg['requests']} requests in {cfg['groups']} groups; each group "
        f"shares a {cfg['system_len']}-token system prompt, then a {cfg['question_len']}-token "
        "question; groups interleaved.",
        f"- `multi-turn`: {cfg['requests'] // cfg['turns']} conversations x {cfg['turns']} turns; "
        f"a turn resends the history ({cfg['user_len']}-token user messages, "
        f"{cfg['output_len']}-token replies) and waits for the previous turn.",
        f"- `few-shot`: {cfg['requests']} requests share one {cfg['shots']} x "
        f"{cfg['shot_len']}-token exemplar block, then a {cfg['question_len']}-token question.",
        f"- `random`: {cfg['requests']} unique prompts of "
        f"{cfg['random_len'] // 2}-{cfg['random_len']} tokens.",
        *stream_lines(cfg),
    ]


def result_lines(record: dict[str, Any], plots_dir: str | None) -> list[str]:
    """The results section: a table per workload, the per-token path, decode, targets, plots."""
    lines = [
        "## Results",
        "",
        "Median over rounds (min-max in brackets when there were several). c: concurrency.",
    ]
    for workload in record["workloads"]:
        lines += ["", f"### {workload}", "", *workload_table(record, workload)]
    if path := path_table(record):
        lines += [
            "",
            "### The per-token path: client ITL against the worker's decode forward",
            "",
            '`radixserve_forward_time_seconds{mode="decode"}` from the worker\'s /metrics over '
            "each cell; its p50 is interpolated within the histogram's buckets, the mean is exact.",
            "",
            *path,
        ]
    if decode := record.get("decode"):
        lines += [
            "",
            f"### Decode at batch {decode['batch']} with {decode['context']}-token contexts",
            "",
            *decode_table(record),
        ]
    targets = list(target_rows(record))
    if targets:
        lines += [
            "",
            "### Targets, as ratios within this run",
            "",
            "| figure | peers | c | ratio | goal | met |",
            "|---|---|---:|---:|---|---|",
            *targets,
        ]
    if record["workloads"] and plots_dir is not None:
        lines += [
            "",
            "### Plots",
            "",
            f"![output throughput against concurrency]({plots_dir}/throughput.png)",
            "",
            f"![TTFT distribution]({plots_dir}/ttft.png)",
        ]
    return lines


def write(record: dict[str, Any], out: Path) -> None:
    """`<out>.md`, keeping what follows NOTES_MARKER in an existing one, and the plots."""
    doc = out.with_suffix(".md")
    notes = doc.read_text().partition(NOTES_MARKER)[2].lstrip("\n") if doc.exists() else ""
    plot = plotter() if record["workloads"] else None
    doc.write_text(markdown(record, os.path.relpath(out, doc.parent) if plot else None, notes))
    if plot is not None:
        plot(record, out)


def plotter() -> Callable[[dict[str, Any], Path], None] | None:
    """plots.plot_all, or None without matplotlib (an extra: `pip install matplotlib`)."""
    try:
        from benchmarks.serving.plots import plot_all
    except ImportError as e:
        print(f"no plots: {e}")
        return None
    return plot_all
