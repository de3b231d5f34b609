"""The LoRA segment kernel (engine/kernels/triton/lora.py) against a float64 reference of each
request's own adapter, and, in the model, against the torch path on the same mixed batch.
Without CUDA it runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports Triton), on small shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from engine.kernels import custom_op
from engine.kernels.triton import lora as lora_triton
from engine.lora import LoRABatchInfo, LoRALayer, LoRAManager
from engine.model.forward_batch import ForwardBatch, ForwardMode
from engine.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from engine.model.runner import ModelRunner
from testing.batches import ExtendInput, build_forward_batch
from tests.engine.lora.conftest import prompt

INTERPRETED = isinstance(lora_triton._segment_matmul_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    not (INTERPRETED or torch.cuda.is_available()), reason="Triton needs CUDA or the interpreter"
)
# Relative to the largest output: the kernel rounds the low-rank product once where the torch
# path rounds it twice, and reduces in another order.
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# The interpreter's bf16 tl.dot is wrong, so bf16 runs on CUDA only.
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
SEGMENT_LENS = [1, 17, 0, 40, 5, 3]
"""Decode-like, two row blocks, empty, three row blocks, short, short."""
SEGMENT_SLOTS = [2, 0, 1, 3, 1, 0]
"""Slot ids: 0 is no adapter, so those rows keep the base output bit for bit."""
RANKS = (8, 4, 2)
SCALINGS = (0.5, 2.0, 1.25)


@pytest.fixture
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers take their Triton branch, here on CPU tensors under the interpreter."""
    monkeypatch.setattr(custom_op, "uses_triton", lambda x: True)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def filled_layer(base: MergedColumnParallelLinear | RowParallelLinear) -> LoRALayer:
    """A LoRA layer over `base` with three adapters of different ranks in its slots."""
    dtype = base.weight.dtype
    scalings = torch.tensor((0.0, *SCALINGS), dtype=dtype, device=DEVICE)
    layer = LoRALayer(base, len(RANKS), max(RANKS), LoRABatchInfo(scalings=scalings))
    outputs = getattr(base, "output_sizes", {"": base.output_size})
    for slot, rank in enumerate(RANKS):
        subs = {
            sid: {
                "lora_A": randn(rank, base.input_size, seed=10 * slot + k),
                "lora_B": randn(size, rank, seed=10 * slot + k + 5),
            }
            for k, (sid, size) in enumerate(outputs.items())
        }
        a, b = layer.slot_weights(subs, rank, "layer")
        layer.write_slot(slot, a.to(dtype), b.to(dtype))
    return layer


def reference(layer: LoRALayer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """In float64, each segment's rows plus its own slot's term, one segment at a time."""
    out, width = y.double(), layer.slot_width
    start = 0
    for length, slot in zip(SEGMENT_LENS, SEGMENT_SLOTS):
        rows = slice(start, start + length)
        start += length
        if slot == 0:
            continue
        cols = slice((slot - 1) * width, slot * width)
        a, b = layer.lora_a[cols].double(), layer.lora_b[:, cols].double()
        out[rows] += SCALINGS[slot - 1] * (x[rows].double() @ a.T) @ b.T
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["qkv", "o"])
def test_segment_kernel_adds_each_requests_own_adapter(
    kind: str, dtype: torch.dtype, triton_path: None
):
    base = (
        MergedColumnParallelLinear(48, {"q": 32, "k": 16, "v": 16})
        if kind == "qkv"
        else RowParallelLinear(40, 48)
    )
    layer = filled_layer(base.to(dtype=dtype, device=DEVICE))
    lens = torch.tensor(SEGMENT_LENS, device=DEVICE)
    layer.batch.seg_indptr = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))
    layer.batch.seg_slots = torch.tensor(SEGMENT_SLOTS, device=DEVICE)
    layer.batch.max_seg_len = max(SEGMENT_LENS)
    x = randn(sum(SEGMENT_LENS), base.input_size, seed=1).to(dtype=dtype, device=DEVICE)
    y = randn(sum(SEGMENT_LENS), base.output_size, seed=2).to(dtype=dtype, device=DEVICE)
    expected = reference(layer, x, y)
    before = y.clone()
    out = layer(x, y)
    assert out is y  # in place, as the torch path adds to the layer's output
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=TOL[dtype] * scale)
    start = 0
    for length, slot in zip(SEGMENT_LENS, SEGMENT_SLOTS):
        rows = slice(start, start + length)
        start += length
        if slot == 0:
            assert torch.equal(out[rows], before[rows])
        elif length:
            assert not torch.equal(out[rows], before[rows])


def test_model_forward_through_the_kernel_equals_the_torch_path(
    tiny_model_dir: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
):
    """The tiny model's mixed prefill (segments of 1 to 40 tokens) and decode step, three
    adapters and the base model, with the LoRA layers on the kernel or on torch ops."""
    runner = ModelRunner(
        tiny_model_dir, dtype="float32", max_total_tokens=1024, enable_lora=True, device=DEVICE
    )
    manager = runner.lora_manager
    assert isinstance(manager, LoRAManager)
    for name, path in adapters.items():
        manager.load(name, str(path))
    names = [None, "attn", "mlp", "all", "mlp"]
    prompts = [prompt(100 + i, n) for i, n in enumerate((5, 40, 17, 1, 23))]
    rows = runner.req_to_token_pool.alloc(len(prompts))
    assert rows is not None
    slots = torch.tensor(manager.acquire(names), device=DEVICE)

    def forward(batch: ForwardBatch, kernels: bool) -> torch.Tensor:
        with monkeypatch.context() as patch:
            patch.setattr(custom_op, "uses_triton", lambda x: kernels)
            return runner.forward(batch)

    def both_paths(reqs: list[ExtendInput], mode: ForwardMode) -> torch.Tensor:
        batch = build_forward_batch(runner, reqs, mode)
        batch.lora_slots = slots
        torch_logits = forward(batch, kernels=False)
        kernel_logits = forward(batch, kernels=True)  # rewrites the same KV
        # float32 through the model, the kernel summing each LoRA product in its own order
        # (and the CPU's GEMM in its own per ISA: 2.7e-5 apart on AVX-512)
        torch.testing.assert_close(kernel_logits, torch_logits, rtol=1e-4, atol=5e-5)
        return torch_logits

    logits = both_paths([ExtendInput(r, 0, p) for r, p in zip(rows, prompts)], ForwardMode.EXTEND)
    tokens = logits.argmax(-1).tolist()
    steps = [ExtendInput(r, len(p), [t]) for r, p, t in zip(rows, prompts, tokens)]
    both_paths(steps, ForwardMode.DECODE)
