"""Decode graphs with LoRA on: a batch's adapter slot ids are one more static input of the
captured graphs, and the graphs always carry the LoRA term. Through the fake graph backend
of tests/engine/model/test_graph_runner.py (host syncs, data-dependent shapes and moved
inputs fail), mixed-adapter decode steps equal eager ones, also after an adapter is swapped
into a slot between replays, and for batches without any adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.lora import LoRAManager
from engine.model.forward_batch import ForwardMode
from engine.model.graph_runner import LORA_PADDING
from engine.model.runner import ModelRunner
from testing.batches import ExtendInput, build_forward_batch
from tests.engine.lora.conftest import prompt
from tests.engine.model.test_graph_runner import FakeGraphBackend, NoAllocationMode

OPTIONS: dict[str, Any] = dict(
    dtype="float64",  # padding a batch to its bucket changes float32 matmul blocking
    max_total_tokens=1024,
    max_running_requests=8,
    enable_lora=True,
    max_loras_per_batch=2,
)
STEPS = 3


def loaded(runner: ModelRunner, adapters: dict[str, Path]) -> LoRAManager:
    manager = runner.lora_manager
    assert isinstance(manager, LoRAManager)
    for name, path in adapters.items():
        manager.load(name, str(path))
    return manager


def decode_logits(
    runner: ModelRunner, names: list[str | None], prompts: list[list[int]]
) -> list[torch.Tensor]:
    """Prefill `prompts` (eagerly) under adapters `names`, then `STEPS` greedy decode steps;
    each step's logits. KV and rows are freed after."""
    manager = runner.lora_manager
    assert manager is not None
    device = runner.device
    slots = torch.tensor(manager.acquire(names), device=device) if any(names) else None
    rows = runner.req_to_token_pool.alloc(len(prompts))
    assert rows is not None
    batch = build_forward_batch(runner, [ExtendInput(r, 0, p) for r, p in zip(rows, prompts)])
    batch.lora_slots = slots
    tokens = runner.forward(batch).argmax(-1).tolist()
    lens = [len(p) for p in prompts]
    steps: list[torch.Tensor] = []
    for _ in range(STEPS):
        reqs = [ExtendInput(r, n, [t]) for r, n, t in zip(rows, lens, tokens)]
        batch = build_forward_batch(runner, reqs, ForwardMode.DECODE)
        batch.lora_slots = slots
        steps.append(runner.forward(batch))
        tokens = steps[-1].argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    for row, n in zip(rows, lens):
        kv = runner.req_to_token_pool.req_to_token[row, :n].long()
        runner.token_to_kv_pool_allocator.free(kv)
    runner.req_to_token_pool.free(rows)
    return steps


BATCHES: list[tuple[list[str | None], list[list[int]]]] = [
    ([None, "attn", "mlp"], [prompt(1, 5), prompt(2, 9), prompt(3, 3)]),  # bucket 4
    # Two slots: "all" swaps in over "attn", the least recently used one.
    (["all", None, "mlp", "all", None], [prompt(4 + i, 4 + i) for i in range(5)]),
    ([None, None], [prompt(9, 6), prompt(10, 7)]),  # no adapter: lora_slots is None
]


def assert_graphs_equal_eager(
    graphed: ModelRunner, eager: ModelRunner, adapters: dict[str, Path], atol: float
) -> None:
    assert graphed.graph_runner is not None and eager.graph_runner is None
    for runner in (graphed, eager):
        loaded(runner, adapters)
    for names, prompts in BATCHES:
        from_graph = decode_logits(graphed, names, prompts)
        from_eager = decode_logits(eager, names, prompts)
        for graph_step, eager_step in zip(from_graph, from_eager):
            torch.testing.assert_close(graph_step, eager_step, rtol=0, atol=atol)


def test_mixed_adapter_decode_through_graphs_equals_eager(
    tiny_model_dir: Path, adapters: dict[str, Path]
):
    backend = FakeGraphBackend()
    graphed = ModelRunner(tiny_model_dir, graph_backend=backend, **OPTIONS)
    captured = len(backend.captured)
    assert_graphs_equal_eager(graphed, ModelRunner(tiny_model_dir, **OPTIONS), adapters, 1e-9)
    assert backend.replayed == [4] * STEPS + [8] * STEPS + [2] * STEPS
    assert len(backend.captured) == captured  # swapping an adapter in needs no recapture


def test_filling_the_slot_ids_pads_with_no_adapter_and_allocates_nothing(
    tiny_model_dir: Path, adapters: dict[str, Path]
):
    runner = ModelRunner(tiny_model_dir, graph_backend=FakeGraphBackend(), **OPTIONS)
    manager = loaded(runner, adapters)
    graph_runner = runner.graph_runner
    assert graph_runner is not None
    slot_ids = graph_runner.inputs.buffers["lora_slots"]
    rows = runner.req_to_token_pool.alloc(3)
    assert rows is not None
    batch = build_forward_batch(runner, [ExtendInput(r, 0, [5]) for r in rows])
    assert batch.forward_mode is ForwardMode.DECODE
    batch.lora_slots = torch.tensor(manager.acquire(["mlp", None, "all"]))
    with NoAllocationMode():
        assert graph_runner.fill(batch) == 4
    assert slot_ids[:4].tolist() == [*batch.lora_slots.tolist(), LORA_PADDING["lora_slots"]]
    batch.lora_slots = None
    with NoAllocationMode():
        graph_runner.fill(batch)
    assert slot_ids[:4].tolist() == [0, 0, 0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_with_the_segment_kernel_equal_eager(
    tiny_model_dir: Path, adapters: dict[str, Path]
):
    """Real CUDA graphs, the LoRA segment kernel captured with its segment buffers."""
    options = {**OPTIONS, "dtype": "float32", "device": "cuda", "mem_fraction_static": 0.5}
    graphed = ModelRunner(tiny_model_dir, **options)
    eager = ModelRunner(tiny_model_dir, disable_cuda_graph=True, **options)
    assert_graphs_equal_eager(graphed, eager, adapters, 1e-4)
