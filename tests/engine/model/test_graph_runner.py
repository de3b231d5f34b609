"""GraphRunner on CPU: bucket choice, padding and static-buffer reuse, through a fake graph
backend that replays the captured callable under checks for what CUDA graph capture would
reject: host syncs, data-dependent shapes, and inputs that move between replays."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.args import EngineArgs
from engine.build import build_scheduler
from engine.model.forward_batch import ForwardBatch, ForwardMode
from engine.model.graph_runner import PADDING, capture_batch_sizes
from engine.model.runner import ModelRunner
from engine.sched.future_map import FutureMap
from testing.batches import ExtendInput, build_forward_batch

aten = torch.ops.aten

DATA_DEPENDENT_SHAPES = {
    aten.nonzero,
    aten.masked_select,
    aten.unique_consecutive,
    aten.unique_dim,
    aten._unique,
    aten._unique2,
}


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    return (t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class GraphSafetyMode(TorchDispatchMode):
    """Fails on an op CUDA graph capture rejects or replays wrongly: a host sync (`item`,
    `bool` of a tensor), an output whose shape depends on the data, a copy between devices,
    a boolean-mask index. `tolist`, `cpu` and `numpy` need no dispatch on a CPU tensor, so
    `guard_host_reads` patches them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in (aten._local_scalar_dense, aten.item):  # aten.item under inference mode
            raise AssertionError("host sync in a graph (item / bool / int of a tensor)")
        if packet in DATA_DEPENDENT_SHAPES:
            raise AssertionError(f"data-dependent shape in a graph: {func}")
        if packet is aten.index and any(
            t.dtype == torch.bool for t in _tensors(args[1:] + tuple(kwargs.values()))
        ):
            raise AssertionError("boolean-mask index in a graph")
        if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
            raise AssertionError("repeat_interleave without output_size in a graph")
        if packet in (aten._to_copy, aten.copy_):
            devices = {t.device for t in _tensors((args, kwargs))}
            if "device" in kwargs:
                devices.add(torch.device(kwargs["device"]))
            if len(devices) > 1:
                raise AssertionError(f"copy between devices in a graph: {devices}")
        return func(*args, **kwargs)


def guard_host_reads(stack: ExitStack) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("host read of a tensor in a graph")

    for name in ("tolist", "cpu", "numpy", "item"):
        stack.enter_context(mock.patch.object(torch.Tensor, name, fail))


class NoAllocationMode(TorchDispatchMode):
    """Fails on any op whose output is new memory: views and in-place ops only."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            if t.numel() and _storage(t) not in inputs:
                raise AssertionError(f"{func} allocated after capture")
        return out


class ReadRecorder(TorchDispatchMode):
    """The storages a call reads that it did not create itself: its captured inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.produced: set[int] = set()
        self.reads: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in _tensors((args, kwargs)):
            if t.numel() and _storage(t) not in self.produced:
                self.reads.add(_storage(t))
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            if t.numel() and _storage(t) not in self.reads:
                self.produced.add(_storage(t))
        return out


class FakeGraphBackend:
    """Capture runs the callable once (as a real capture traces it once) and records the
    storages it reads; replay calls it again under GraphSafetyMode, checks that it read
    exactly those storages, at the same addresses, and returns the output in the tensor
    capture returned, as a CUDA graph does."""

    static_shapes = True

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replayed: list[int] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        with ReadRecorder() as recorder:
            static_output = fn()
        captured_reads, rows = recorder.reads, static_output.shape[0]
        self.captured.append(rows)

        def replay() -> torch.Tensor:
            with ExitStack() as stack:
                guard_host_reads(stack)
                recorder = stack.enter_context(ReadRecorder())
                stack.enter_context(GraphSafetyMode())
                out = fn()
            assert recorder.reads == captured_reads, "a replay read other inputs than capture"
            self.replayed.append(rows)
            return static_output.copy_(out)

        return replay


@pytest.fixture
def llama_dir(tmp_path, hf_model_factory):
    hf_model_factory("llama").save_pretrained(tmp_path)
    return tmp_path


def graph_runner_pair(
    runner_factory: Callable[..., ModelRunner], path: Any, **kwargs: Any
) -> tuple[ModelRunner, ModelRunner, FakeGraphBackend]:
    backend = FakeGraphBackend()
    graphed = runner_factory(path, graph_backend=backend, **kwargs)
    return graphed, runner_factory(path, **kwargs), backend


def decode_batch(runner: ModelRunner, prompts: list[list[int]]) -> ForwardBatch:
    """Prefill `prompts` (eagerly), then lay out one decode step for all of them."""
    rows = runner.req_to_token_pool.alloc(len(prompts))
    assert rows is not None
    runner.forward(
        build_forward_batch(runner, [ExtendInput(r, 0, p) for r, p in zip(rows, prompts)])
    )
    return build_forward_batch(
        runner, [ExtendInput(r, len(p), [p[-1]]) for r, p in zip(rows, prompts)]
    )


def test_buckets_are_powers_of_two_to_eight_then_steps_of_eight_up_to_the_cap():
    assert capture_batch_sizes(160) == [1, 2, 4, *range(8, 161, 8)]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(1) == [1]


def test_graphs_are_captured_largest_first_up_to_max_running_requests(llama_dir, runner_factory):
    backend = FakeGraphBackend()
    runner = runner_factory(llama_dir, graph_backend=backend, cuda_graph_max_bs=160)
    assert backend.captured == [16, 8, 4, 2, 1]  # max_running_requests is 16
    graph_runner = runner.graph_runner
    assert graph_runner is not None
    assert [graph_runner.bucket(n) for n in (1, 3, 4, 5, 9, 16)] == [1, 4, 4, 8, 16, 16]
    clipped = runner_factory(llama_dir, graph_backend=FakeGraphBackend(), cuda_graph_max_bs=10)
    assert clipped.graph_runner is not None and clipped.graph_runner.batch_sizes[-1] == 10
    off = runner_factory(llama_dir, graph_backend=FakeGraphBackend(), disable_cuda_graph=True)
    assert off.graph_runner is None
    assert runner_factory(llama_dir).graph_runner is None  # CPU: no graphs unless injected


def test_filling_copies_into_the_static_buffers_pads_the_bucket_and_allocates_nothing(
    llama_dir, runner_factory, prompts_factory
):
    runner = runner_factory(llama_dir, graph_backend=FakeGraphBackend())
    graph_runner = runner.graph_runner
    assert graph_runner is not None
    buffers = graph_runner.inputs.buffers
    addresses = {name: b.data_ptr() for name, b in buffers.items()}
    eight = decode_batch(runner, prompts_factory([3] * 8))
    five = decode_batch(runner, prompts_factory([4] * 5, seed=1))
    for fb, bucket in ((eight, 8), (five, 8)):
        with NoAllocationMode():
            assert graph_runner.fill(fb) == bucket
        n = fb.batch_size
        for name, buffer in buffers.items():
            assert torch.equal(buffer[:n], getattr(fb, name)), name
            assert (buffer[n:bucket] == PADDING[name]).all(), name  # rows 5..7 re-padded
    assert {name: b.data_ptr() for name, b in buffers.items()} == addresses


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("batch_size", [3, 4])  # 3 is padded to the bucket of 4
def test_graph_decode_equals_eager_and_gives_the_same_greedy_tokens(
    dtype, batch_size, llama_dir, runner_factory, greedy, prompts_factory
):
    graphed, eager, backend = graph_runner_pair(runner_factory, llama_dir, dtype=dtype)
    prompts = prompts_factory([5, 17, 2, 30][:batch_size], seed=2)
    from_graph = greedy(graphed, prompts, max_new_tokens=4)
    from_eager = greedy(eager, prompts, max_new_tokens=4)
    assert backend.replayed == [4, 4, 4]  # every decode step; the prefill ran eagerly
    assert from_graph.tokens == from_eager.tokens
    for graph_logits, eager_logits in zip(from_graph.logits, from_eager.logits):
        torch.testing.assert_close(torch.stack(graph_logits), torch.stack(eager_logits))


def test_oversize_batches_run_eagerly(llama_dir, runner_factory, prompts_factory):
    backend = FakeGraphBackend()
    runner = runner_factory(llama_dir, graph_backend=backend, cuda_graph_max_bs=2)
    runner.forward(decode_batch(runner, prompts_factory([3, 4, 5])))
    assert backend.replayed == []
    runner.forward(decode_batch(runner, prompts_factory([6, 7])))
    assert backend.replayed == [2]


def test_future_input_ids_are_resolved_inside_the_graph(llama_dir, runner_factory, prompts_factory):
    graphed, eager, backend = graph_runner_pair(runner_factory, llama_dir)
    prompts = prompts_factory([6, 9, 11], seed=4)
    tokens = torch.tensor([p[-1] for p in prompts])
    expected = eager.forward(decode_batch(eager, prompts))
    fb = decode_batch(graphed, prompts)
    future_map = FutureMap(graphed.req_to_token_pool.size, torch.device("cpu"))
    future_map.store(fb.req_pool_indices, tokens)
    fb.input_ids = FutureMap.futures(fb.req_pool_indices)
    captured = len(backend.captured)
    logits = graphed.forward_output(fb, resolve_input_ids=future_map.resolve).next_token_logits
    assert len(backend.captured) == 2 * captured  # recaptured once, with the resolver in
    assert backend.replayed == [4]
    torch.testing.assert_close(logits, expected)
    graphed.forward_output(fb, resolve_input_ids=future_map.resolve)
    assert len(backend.captured) == 2 * captured  # the same resolver: no recapture


def test_the_scheduler_captures_once_with_its_future_lookup(llama_dir, runner_factory):
    """A runner built with `capture_graphs=False` (as the engine builds its own) leaves the
    capture to the scheduler, so every bucket is captured once, with the FutureMap's lookup
    in, and the first decode batch recaptures nothing."""
    backend = FakeGraphBackend()
    runner = runner_factory(llama_dir, graph_backend=backend, capture_graphs=False)
    assert backend.captured == []
    scheduler = build_scheduler(EngineArgs(model=str(llama_dir), device="cpu"), runner)
    assert backend.captured == [16, 8, 4, 2, 1]
    graph_runner = runner.graph_runner
    assert graph_runner is not None
    assert graph_runner.resolve_input_ids == scheduler.batch_runner.future_map.resolve


def test_eager_forward_resolves_futures_too(llama_dir, runner_factory, prompts_factory):
    runner = runner_factory(llama_dir)
    prompts = prompts_factory([6, 9], seed=5)
    expected = runner.forward(decode_batch(runner, prompts))
    fb = decode_batch(runner, prompts)
    future_map = FutureMap(runner.req_to_token_pool.size, torch.device("cpu"))
    future_map.store(fb.req_pool_indices, torch.tensor([p[-1] for p in prompts]))
    fb.input_ids = FutureMap.futures(fb.req_pool_indices)
    logits = runner.forward_output(fb, resolve_input_ids=future_map.resolve).next_token_logits
    torch.testing.assert_close(logits, expected)
    assert fb.forward_mode is ForwardMode.DECODE
