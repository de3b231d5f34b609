"""Decode step time with and without CUDA graphs, the model alone (no scheduler, no server).

Prints, as one JSON object (also written to --out):
- `launch_us`: the cost of one tiny kernel launched eagerly from Python, and of the same
  kernel replayed from a graph (how much of an eager step is launch overhead);
- `steps`: per batch size, the median decode step (ms) eager and from graphs over
  `--context`-token contexts, and their ratio;
- `greedy_equal`: whether greedy tokens from graphs equal eager ones over `--greedy-steps`.

Run on a GPU:  python -m benchmarks.graph_bench --out OUT/graph_bench.json
CPU smoke (checks the plumbing, measures nothing; graphs are "replayed" by calling the
captured step again):  python -m benchmarks.graph_bench --device cpu --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.model.runner import ModelRunner
from testing.batches import ExtendInput, build_forward_batch


class CallAgain:
    """A graph backend for CPU runs of this script: replay calls the step again."""

    static_shapes = True

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return fn


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def launch_cost_us(device: torch.device, ops: int = 2000) -> dict[str, float]:
    """Microseconds per tiny op (`x.add_(1)` on 1 element), eager and graph-replayed."""
    x = torch.zeros(1, device=device)

    def step() -> torch.Tensor:
        for _ in range(ops):
            x.add_(1)
        return x

    step()
    sync(device)
    start = time.perf_counter()
    step()
    sync(device)
    eager = (time.perf_counter() - start) / ops * 1e6
    if device.type != "cuda":
        return {"eager": eager}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    sync(device)
    start = time.perf_counter()
    graph.replay()
    sync(device)
    return {"eager": eager, "graph": (time.perf_counter() - start) / ops * 1e6}


def make_runner(args: argparse.Namespace, graphs: bool) -> ModelRunner:
    max_bs = max(args.batch_sizes)
    tokens = max_bs * (args.context + args.steps + args.greedy_steps + 2)
    return ModelRunner(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_total_tokens=tokens,
        max_running_requests=max_bs,
        cuda_graph_max_bs=max_bs,
        disable_cuda_graph=not graphs,
        graph_backend=CallAgain() if graphs and args.device == "cpu" else None,
    )


def decode(
    runner: ModelRunner, batch_size: int, context: int, steps: int, seed: int
) -> tuple[list[float], list[list[int]]]:
    """Prefill `batch_size` random `context`-token prompts, then decode greedily: the
    forward time of each step (ms) and the tokens. Frees the pools after."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    rows = runner.req_to_token_pool.alloc(batch_size)
    assert rows is not None
    prompts = [torch.randint(3, vocab, (context,), generator=gen).tolist() for _ in rows]
    batch = [ExtendInput(row, 0, prompt) for row, prompt in zip(rows, prompts)]
    times, tokens = [], []
    for step in range(steps + 1):
        fb = build_forward_batch(runner, batch)
        sync(runner.device)
        start = time.perf_counter()
        logits = runner.forward(fb)
        sync(runner.device)
        if step:  # step 0 is the prefill
            times.append((time.perf_counter() - start) * 1e3)
        next_tokens = logits.argmax(-1).tolist()
        tokens.append(next_tokens)
        batch = [
            ExtendInput(req.req_pool_idx, req.prefix_len + len(req.input_ids), [token])
            for req, token in zip(batch, next_tokens)
        ]
    runner.token_to_kv_pool_allocator.clear()
    runner.req_to_token_pool.clear()
    return times, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps")
    parser.add_argument("--greedy-steps", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: plumbing only")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.batch_sizes, args.context, args.steps, args.greedy_steps = [3, 6], 8, 2, 3
    device = torch.device(args.device)
    result: dict[str, Any] = {"device": str(device), "dtype": args.dtype, "context": args.context}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    result["launch_us"] = launch_cost_us(device, 50 if args.smoke else 2000)
    runners = {"eager": make_runner(args, graphs=False), "graph": make_runner(args, graphs=True)}
    result["steps"] = {}
    for bs in args.batch_sizes:
        medians = {
            name: statistics.median(decode(runner, bs, args.context, args.steps, seed=bs)[0])
            for name, runner in runners.items()
        }
        result["steps"][bs] = {**medians, "speedup": medians["eager"] / medians["graph"]}
        print(f"batch {bs:>4} x {args.context}: {medians}", flush=True)
    greedy = {
        name: decode(runner, min(8, max(args.batch_sizes)), args.context, args.greedy_steps, 0)[1]
        for name, runner in runners.items()
    }
    result["greedy_equal"] = greedy["eager"] == greedy["graph"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if not result["greedy_equal"]:
        raise SystemExit("greedy tokens from graphs differ from eager ones")


if __name__ == "__main__":
    main()
