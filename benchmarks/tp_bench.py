"""Decode step time of a model (default: the embedded SmolLM2-135M) at several TP sizes on
CPU (gloo), and the share of a step spent in the all-reduces (and the LM head's
all-gather). The embedded model has 9 heads and 3 KV heads, so it splits over 3 ranks, not
2 (`--model` takes any other model, e.g. one with 8 heads for TP=2).

Each TP size runs in its own spawned ranks; the CPU's cores are split evenly between the
ranks (TP=1 gets them all), so the comparison is the same machine cut two ways. A batch of
`--batch` random prompts of `--context` tokens is prefilled once, then `--steps` decode
steps are timed one by one (median). The collectives are timed by wrapping the TPGroup's
methods (each call waits for the slowest rank, so its time includes skew between ranks).
Results: docs/benchmarks/tp.md.

    .venv/bin/python benchmarks/tp_bench.py
    .venv/bin/python benchmarks/tp_bench.py --model PATH --tp-sizes 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

# isort: off
import engine  # noqa: F401  first: it sets the OpenMP defaults before torch loads OpenMP
import torch
import torch.multiprocessing as mp

# isort: on
from engine.distributed import ParallelConfig, TPGroup, destroy_distributed, init_distributed
from engine.model.runner import ModelRunner
from testing.batches import ExtendInput, build_forward_batch


class CollectiveTimer:
    """Seconds spent in the group's all-reduces and all-gathers since the last `take`."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, group: TPGroup, name: str) -> None:
        inner: Callable[..., torch.Tensor] = getattr(group, name)

        def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(group, name, timed)

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def decode_steps(args: argparse.Namespace, timer: CollectiveTimer) -> dict[str, float]:
    """Prefill the batch, then time each decode step and its collectives (medians, ms)."""
    runner = ModelRunner(
        args.model,
        dtype=args.dtype,
        max_total_tokens=args.batch * (args.context + args.steps + 2),
        max_running_requests=args.batch + 1,
    )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        3, runner.model_config.vocab_size, (args.batch, args.context), generator=gen
    )
    rows = runner.req_to_token_pool.alloc(args.batch)
    assert rows is not None
    batch = [ExtendInput(row, 0, prompt.tolist()) for row, prompt in zip(rows, prompts)]
    step_s, collective_s = [], []
    for step in range(args.steps + 1):
        timer.take()
        start = time.perf_counter()
        tokens = runner.forward(build_forward_batch(runner, batch)).argmax(-1).tolist()
        if step > 0:  # step 0 is the prefill
            step_s.append(time.perf_counter() - start)
            collective_s.append(timer.take())
        batch = [
            ExtendInput(req.req_pool_idx, req.prefix_len + len(req.input_ids), [token])
            for req, token in zip(batch, tokens)
        ]
    step, collective = statistics.median(step_s), statistics.median(collective_s)
    return {"step_ms": 1e3 * step, "collective_ms": 1e3 * collective, "share": collective / step}


def rank_main(rank: int, tp: int, addr: str, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    group = init_distributed(ParallelConfig(tp, rank, addr), torch.device("cpu"))
    timer = CollectiveTimer()
    for name in ("all_reduce", "all_gather"):
        timer.wrap(group, name)
    try:
        numbers = decode_steps(args, timer)
        if rank == 0:
            results[tp] = {**numbers, "threads_per_rank": torch.get_num_threads()}
    finally:
        destroy_distributed()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    results = mp.Manager().dict()
    for tp in args.tp_sizes:
        addr = f"127.0.0.1:{free_port()}"
        mp.spawn(rank_main, args=(tp, addr, args, results), nprocs=tp, join=True)
    print(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "tp": dict(results)}, indent=2))


if __name__ == "__main__":
    main()
