"""The engine's own work per decode step, against another tree, and the overlap loop hiding it.

Part 1: the whole decode step at batch 32, 128 and 256 with a test model whose forward is
nearly free (vocabulary 512, 2 layers of width 16, float32, one torch thread): what is left
is the scheduler, the batch layout, the sampler and the result processing. The same code
runs on this tree and on another (a `git worktree` of an older commit, created if missing)
in fresh subprocesses whose PYTHONPATH points at the tree, interleaved, in one run.

Part 2: with a real test model whose forward is one to two times the host work (wider,
still one torch thread), the forward (`run_batch`, timed inside the normal loop, so at the
contexts both loops run at), the normal loop's step and the overlap loop's step. The
overlap loop should cost about the forward; the normal loop the forward plus the
scheduler's own work. Inside each loop `run_batch` is timed in wall and in its thread's CPU
time: under the overlap loop, wall minus CPU is time the forward thread waited.

Each figure is the median over `--repeats` subprocesses of the median over timing windows
of `--steps` decode steps, wall clock (and the process's CPU time, which other load on a
shared machine disturbs less).

Run: flock /tmp/radixserve-bench.lock .venv/bin/python -m benchmarks.host_bench
Results are recorded in docs/benchmarks/host.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
NEARLY_FREE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=1,
    num_key_value_heads=1,
)
"""Two layers of one 16-wide head: the forward is a few dozen tiny ops."""


def real_model(hidden_size: int) -> dict[str, Any]:
    """Wide enough that the forward's time is mostly in matmuls, which release the GIL:
    at 160 the bf16 forward is about 1.7x the host work (256: about 1.9x), the float32 one
    about 3x."""
    return dict(
        vocab_size=512,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


PROMPT_LEN = 4


def child(options: argparse.Namespace) -> None:
    """In a subprocess: decode `batch` requests and print the per-step times as JSON.
    Uses only the engine API that both trees have."""
    import torch

    torch.set_num_threads(1)
    import engine
    from engine.api import Engine
    from engine.sampling.sampling_params import SamplingParams
    from engine.sched.req import Req
    from engine.sched.scheduler import after_turns

    batch, steps, windows, warmup = options.batch, options.steps, options.windows, 5
    max_new = warmup + steps * windows + 8
    eng = Engine(
        options.model,
        dtype=options.dtype,
        device="cpu",
        skip_tokenizer_init=True,
        max_running_requests=batch,
        max_total_tokens=batch * (PROMPT_LEN + max_new + 8),
        disable_overlap_schedule=options.child != "overlap",
    )
    scheduler = eng.scheduler
    for i in range(batch):
        prompt = [3 + (i * 7 + j) % 500 for j in range(PROMPT_LEN)]
        params = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
        scheduler.add_request(Req(str(i), prompt, params))
    while scheduler.prefill.waiting or len(scheduler.running) < batch:
        scheduler.run_event_loop(after_turns(1))
    scheduler.run_event_loop(after_turns(warmup))
    wall: list[float] = []
    cpu: list[float] = []
    run_batch_ms: list[float] = []
    run_batch_cpu_ms: list[float] = []
    # run_batch's seconds on whichever thread runs it, wall and that thread's CPU time:
    # the difference is time it waited (for the GIL, under the overlap loop's thread).
    forward_side: list[float] = []
    forward_side_cpu: list[float] = []
    run_batch = scheduler.run_batch

    def timed_run_batch(step: Any) -> Any:
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            return run_batch(step)
        finally:
            forward_side.append(time.perf_counter() - started)
            forward_side_cpu.append(time.thread_time() - started_cpu)

    scheduler.run_batch = timed_run_batch  # type: ignore[method-assign]
    for _ in range(windows):
        forward_side.clear()
        forward_side_cpu.clear()
        start, start_cpu = time.perf_counter(), time.process_time()
        scheduler.run_event_loop(after_turns(steps))
        wall.append((time.perf_counter() - start) / steps * 1e3)
        cpu.append((time.process_time() - start_cpu) / steps * 1e3)
        run_batch_ms.append(sum(forward_side) / len(forward_side) * 1e3)
        run_batch_cpu_ms.append(sum(forward_side_cpu) / len(forward_side_cpu) * 1e3)
    print(
        json.dumps(
            {
                "wall_ms": wall,
                "cpu_ms": cpu,
                "run_batch_ms": run_batch_ms,
                "run_batch_cpu_ms": run_batch_cpu_ms,
                "engine": engine.__file__,
            }
        )
    )
    os._exit(0)  # skip shutdown: the forward thread may hold the last batch


def measure(
    tree: Path,
    model: Path,
    batch: int,
    loop: str,
    options: argparse.Namespace,
    dtype: str = "float32",
) -> dict:
    """One subprocess on `tree`: medians of its timing windows."""
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--child", loop]
    cmd += ["--model", str(model), "--batch", str(batch)]
    cmd += ["--steps", str(options.steps), "--windows", str(options.windows)]
    cmd += ["--dtype", dtype]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, text=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(data["engine"]).is_relative_to(tree), f"{data['engine']} is not under {tree}"
    return {k: statistics.median(v) for k, v in data.items() if k != "engine" and v}


def ensure_worktree(path: Path, commit: str) -> None:
    if not path.exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(path), commit], cwd=REPO, check=True
        )


def save_models(root: Path, real_hidden_size: int) -> tuple[Path, Path]:
    from testing.models import save_tiny_model

    free, real = root / "nearly-free", root / "real"
    save_tiny_model(free, **NEARLY_FREE)
    save_tiny_model(real, **real_model(real_hidden_size))
    return free, real


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=["normal", "overlap"])
    parser.add_argument("--model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--overlap-batch", type=int, default=128)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="bfloat16",
        help="part 2's real model (bfloat16: the CPU kernels' one-op decode layer)",
    )
    parser.add_argument("--hidden-size", type=int, default=160, help="part 2's real model")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path, default=Path("/tmp/rs-main-h4"))
    parser.add_argument("--baseline-commit", default="9130455")
    parser.add_argument("--also", type=Path, nargs="*", default=[], help="more trees to time")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--skip-overlap", action="store_true")
    parser.add_argument("--only-overlap", action="store_true")
    options = parser.parse_args()
    if options.child:
        child(options)
        return

    trees = {"this tree": REPO, **{str(path): path for path in options.also}}
    if not options.skip_baseline:
        ensure_worktree(options.baseline_tree, options.baseline_commit)
        trees[f"main {options.baseline_commit}"] = options.baseline_tree
    with tempfile.TemporaryDirectory() as tmp:
        free, real = save_models(Path(tmp), options.hidden_size)
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; one torch thread")
        if not options.only_overlap:
            host_part(options, trees, free)
        if not options.skip_overlap:
            overlap_part(options, free, real)


def host_part(options: argparse.Namespace, trees: dict[str, Path], free: Path) -> None:
    """Part 1: the nearly-free model's whole step on each tree."""
    print(f"\nPart 1: whole decode step, nearly-free model {NEARLY_FREE}, normal loop")
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(options.repeats):
        for batch in options.batch_sizes:
            for name, tree in trees.items():
                runs.setdefault((name, batch), []).append(
                    measure(tree, free, batch, "normal", options)
                )
    print("\n| batch | " + " | ".join(f"{n} ms (cpu ms)" for n in trees) + " | this / last |")
    print("|---:|" + "---:|" * (len(trees) + 1))
    for batch in options.batch_sizes:
        cells = [
            f"{median_of(r, 'wall_ms'):.2f} ({median_of(r, 'cpu_ms'):.2f})"
            for r in (runs[n, batch] for n in trees)
        ]
        walls = [median_of(runs[n, batch], "wall_ms") for n in trees]
        ratio = f"{walls[0] / walls[-1]:.2f}" if len(walls) > 1 else "-"
        print(f"| {batch} | " + " | ".join(cells) + f" | {ratio} |")


def overlap_part(options: argparse.Namespace, free: Path, real: Path) -> None:
    """Part 2: the real model's forward, and both loops' steps, on this tree."""
    batch = options.overlap_batch
    config = real_model(options.hidden_size)
    print(f"\nPart 2: overlap, real model {config} in {options.dtype}, batch {batch}, this tree")
    overlap_runs: dict[str, list[dict]] = {}
    for _ in range(options.repeats):
        overlap_runs.setdefault("host", []).append(measure(REPO, free, batch, "normal", options))
        for loop in ("normal", "overlap"):
            overlap_runs.setdefault(loop, []).append(
                measure(REPO, real, batch, loop, options, options.dtype)
            )
    host = median_of(overlap_runs["host"], "wall_ms")
    forward = median_of(overlap_runs["normal"], "run_batch_ms")
    print("\n| measured | ms per step | / forward |")
    print("|---|---:|---:|")
    rows = [
        ("host work (nearly-free model, normal loop)", host),
        ("forward (real model, run_batch inside the normal loop)", forward),
        ("normal loop step (real model)", median_of(overlap_runs["normal"], "wall_ms")),
        ("overlap loop step (real model)", median_of(overlap_runs["overlap"], "wall_ms")),
    ]
    for label, ms in rows:
        print(f"| {label} | {ms:.2f} | {ms / forward:.2f} |")
    print(f"\nforward / host work = {forward / host:.2f}; forward + host = {forward + host:.2f}")
    print("\nInside the loops (the same runs): the forward side is `run_batch` (forward and")
    print("sampling, on the forward thread under the overlap loop), the rest is the")
    print("scheduler's own work the overlap loop can hide; the last column divides by the")
    print("forward above (the normal loop's forward side).")
    print(
        "\n| loop | step ms | forward side ms (its thread's cpu ms) "
        "| step - forward side ms | step / forward |"
    )
    print("|---|---:|---:|---:|---:|")
    for loop in ("normal", "overlap"):
        step = median_of(overlap_runs[loop], "wall_ms")
        side = median_of(overlap_runs[loop], "run_batch_ms")
        side_cpu = median_of(overlap_runs[loop], "run_batch_cpu_ms")
        print(
            f"| {loop} | {step:.2f} | {side:.2f} ({side_cpu:.2f}) | {step - side:.2f} | "
            f"{step / forward:.2f} |"
        )


if __name__ == "__main__":
    main()
