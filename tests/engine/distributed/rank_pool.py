"""Rank processes for the tensor-parallel tests: `RankPool` and the tasks it runs on every
rank. Apart from the tests so that a spawned rank imports only the engine (the test module
imports transformers, which would add seconds to every rank's start)."""

from __future__ import annotations

import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from engine.distributed import ParallelConfig, destroy_distributed, get_tp_group, init_distributed
from engine.model.runner import ModelRunner
from testing.batches import ExtendInput, build_forward_batch

TASK_TIMEOUT_S = 120.0
"""How long the test waits for every rank's answer to one task before it fails."""
RUNNER_OPTIONS = dict(max_total_tokens=512, max_running_requests=4, cuda_graph_max_bs=4)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve_rank(rank: int, size: int, addr: str, tasks: Any, results: Any) -> None:
    """One rank: join the group, then run each task `(fn, args)` until None arrives."""
    torch.set_num_threads(1)
    group = init_distributed(ParallelConfig(size, rank, addr, timeout_s=60), torch.device("cpu"))
    group.start_serving()  # the tasks' collectives wait 60 s, not the start-up timeout
    try:
        while (task := tasks.get()) is not None:
            fn, args = task
            try:
                results.put((rank, None, fn(*args)))
            except Exception:
                results.put((rank, traceback.format_exc(), None))
    finally:
        destroy_distributed()


class RankPool:
    """`size` spawned processes forming one tensor-parallel group; `run` gives every rank
    the same task (they meet in its collectives) and returns their answers by rank."""

    def __init__(self, size: int):
        ctx = mp.get_context("spawn")
        addr = f"127.0.0.1:{free_port()}"
        self.size = size
        self.tasks = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_serve_rank,
                args=(rank, size, addr, self.tasks[rank], self.results),
                daemon=True,  # never outlives the test process
            )
            for rank in range(size)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        for queue in self.tasks:
            queue.put((fn, args))
        answers: dict[int, Any] = {}
        for _ in range(self.size):
            rank, error, value = self.results.get(timeout=TASK_TIMEOUT_S)
            if error is not None:
                self.close()  # the other ranks may be stuck in a collective
                raise AssertionError(f"rank {rank} failed:\n{error}")
            answers[rank] = value
        return [answers[rank] for rank in range(self.size)]

    def close(self) -> None:
        for queue in self.tasks:
            queue.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


_RUNNERS: dict[tuple[str, str, bool], ModelRunner] = {}


def cached_runner(model: str, dtype: str, graphs: bool = False) -> ModelRunner:
    """One runner per (model, dtype, graphs) and process: loading is most of a task."""
    key = (model, dtype, graphs)
    if key not in _RUNNERS:
        backend = None
        if graphs:  # imported here: only the TP=2 pool captures graphs
            from tests.engine.model.test_graph_runner import FakeGraphBackend

            backend = FakeGraphBackend()
        _RUNNERS[key] = ModelRunner(model, dtype=dtype, graph_backend=backend, **RUNNER_OPTIONS)
    return _RUNNERS[key]


def greedy_steps(
    model: str, dtype: str, prompts: list[list[int]], steps: int, graphs: bool = False
) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill `prompts` in one batch, then decode them together, taking the argmax: the
    logits of every step, and how many all-reduces each step made. Frees what it took."""
    runner = cached_runner(model, dtype, graphs)
    group = get_tp_group()
    rows = runner.req_to_token_pool.alloc(len(prompts))
    assert rows is not None
    batch = [ExtendInput(row, 0, prompt) for row, prompt in zip(rows, prompts)]
    logits_per_step, calls = [], []
    for _ in range(steps):
        before = group.all_reduce_calls
        logits = runner.forward(build_forward_batch(runner, batch))
        calls.append(group.all_reduce_calls - before)
        logits_per_step.append(logits)
        batch = [
            ExtendInput(req.req_pool_idx, req.prefix_len + len(req.input_ids), [token])
            for req, token in zip(batch, logits.argmax(-1).tolist())
        ]
    for req in batch:
        runner.token_to_kv_pool_allocator.free(
            runner.req_to_token_pool.req_to_token[req.req_pool_idx, : req.prefix_len].long()
        )
    runner.req_to_token_pool.free(rows)
    return logits_per_step, calls


def held_shards(model: str) -> dict[str, Any]:
    """Layer 0's and the vocabulary's parameters as this rank holds them, and its KV pool's
    and attention backend's head counts."""
    runner = cached_runner(model, "float32")
    params = {
        name: param.detach().clone()
        for name, param in runner.model.named_parameters()
        if ".layers.0." in name or "embed_tokens" in name or "lm_head" in name
    }
    pool = runner.token_to_kv_pool
    return {
        "params": params,
        "kv_buffers": {tuple(b.shape) for b in pool.k_buffer + pool.v_buffer},
        "attn_heads": (runner.attn_backend.num_heads, runner.attn_backend.num_kv_heads),
    }


def load_refusal(model: str) -> str:
    """The error loading `model` at this group's size gives ("" if it loads)."""
    try:
        ModelRunner(model, dtype="float32", **RUNNER_OPTIONS)
    except ValueError as err:
        return str(err)
    return ""


def graph_replays(model: str) -> list[int]:
    """The buckets this rank's fake graph backend has replayed."""
    backend = cached_runner(model, "float32", graphs=True).graph_runner.backend
    return list(backend.replayed)


def held_kv_heads(model: str) -> int:
    return cached_runner(model, "float32").token_to_kv_pool.head_num
