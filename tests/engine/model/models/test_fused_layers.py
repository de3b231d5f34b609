"""The decoder's fused steps: the Triton kernels give the torch path's logits (run on CPU
under Triton's interpreter), the torch path stays short per layer on CPU, where every op
costs its dispatch at decode sizes, and a bf16 decode layer runs as one C++ op
(`cpu_ops.decode_layer`) with the modules' results."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.kernels import custom_op
from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.model.layers.radix_attention import RadixAttention
from engine.model.models.llama import LlamaDecoderLayer
from engine.model.runner import ModelRunner
from testing.batches import ExtendInput, build_forward_batch
from tests.engine.model.conftest import GreedyResult, run_greedy
from tests.engine.model.test_loader import write_gguf
from tests.engine.model.test_quantization import MIXED_PARTS

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

MAX_OPS_PER_LAYER = 22
"""Ops one decoder layer dispatches outside attention on CPU in bf16: 57 before the fusions
(75 with the torch backend's attention)."""


def prefill_then_decode(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    rows = runner.req_to_token_pool.alloc(len(prompts))
    prefill = runner.forward(
        build_forward_batch(runner, [ExtendInput(r, 0, p) for r, p in zip(rows, prompts)])
    )
    decode = runner.forward(
        build_forward_batch(runner, [ExtendInput(r, len(p), [5]) for r, p in zip(rows, prompts)])
    )
    return [prefill, decode]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k norms before rotary
def test_triton_kernels_give_the_torch_paths_logits(
    arch, hf_model_factory, runner_factory, prompts_factory, tmp_path, monkeypatch
):
    """On CUDA tensors with CUDA, under Triton's interpreter on CPU tensors without."""
    hf_model_factory(arch).save_pretrained(tmp_path)
    runner = runner_factory(tmp_path, dtype="float32", device=TRITON_DEVICE)
    prompts = prompts_factory([6, 1, 9])
    monkeypatch.setattr(custom_op, "uses_triton", lambda x: False)
    expected = prefill_then_decode(runner, prompts)
    monkeypatch.setattr(custom_op, "uses_triton", lambda x: True)
    for ours, reference in zip(prefill_then_decode(runner, prompts), expected):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_a_decode_layer_dispatches_few_ops_besides_attention(
    hf_model_factory, runner_factory, tmp_path, monkeypatch
):
    hf_model_factory("llama").save_pretrained(tmp_path)
    runner = runner_factory(tmp_path, dtype="bfloat16")
    monkeypatch.setattr(RadixAttention, "forward", lambda self, q, k, v, forward_batch: q)
    model = runner.model.model
    hidden = torch.randn(4, runner.model_config.hidden_size, dtype=torch.bfloat16)
    cos_sin = model.rotary_emb.cos_sin(torch.arange(4), torch.bfloat16)
    residual = hidden.clone()
    counter = OpCounter()
    with torch.inference_mode(), counter:
        model.layers[1](cos_sin, hidden, residual, None)
    assert sum(counter.counts.values()) <= MAX_OPS_PER_LAYER, counter.counts


one_op_layers = pytest.mark.skipif(
    not (cpu_build.available() and cpu_ops.amx_available()),
    reason="the one-op decode layer takes the AMX matmul, which this CPU lacks",
)


def count_decode_layer_calls(monkeypatch) -> list[int]:
    """Counts calls of the real `cpu_ops.decode_layer` (each call's batch size)."""
    calls: list[int] = []
    real = cpu_ops.decode_layer

    def counted(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return real(hidden, *args)

    monkeypatch.setattr(cpu_ops, "decode_layer", counted)
    return calls


def greedy_as_the_modules(
    runner: ModelRunner, prompts: list[list[int]], monkeypatch, tolerance: float = 0.0
) -> GreedyResult:
    """Four greedy tokens of `prompts`, every decode layer run as one op, checked against
    the modules alone: the same tokens, each step's logits within `tolerance` (0: bit for
    bit; the K/V the op writes is what later steps attend to). Returns the op's run."""
    calls = count_decode_layer_calls(monkeypatch)
    ours = run_greedy(runner, prompts, 4)
    assert calls == [len(prompts)] * 3 * runner.model_config.num_hidden_layers  # 3 decode steps
    with monkeypatch.context() as modules_only:
        modules_only.setattr(LlamaDecoderLayer, "decode_weights", lambda self, dtype: None)
        theirs = run_greedy(runner, prompts, 4)
    assert ours.tokens == theirs.tokens
    for our_steps, their_steps in zip(ours.logits, theirs.logits, strict=True):
        for a, b in zip(our_steps, their_steps, strict=True):
            torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)
    return ours


ONE_OP_ARCHS = ["llama", "qwen3", "gemma3"]
"""Llama's layer, Qwen3's q/k norms, Gemma 3's four norms, q/k norms, GELU and window."""


@one_op_layers
@pytest.mark.parametrize("arch", ONE_OP_ARCHS)
def test_a_bf16_decode_layer_runs_as_one_op_with_the_modules_results(
    arch, hf_model_factory, runner_factory, prompts_factory, tmp_path, monkeypatch
):
    """Same kernels in the same order: greedy tokens and every step's logits are equal,
    bit for bit, to the modules'; batch 1 takes the few-rows matmul, batch 3 the AMX one.
    Gemma 3's contexts outgrow its sliding layer's window of 8."""
    hf_model_factory(arch).save_pretrained(tmp_path)
    runner = runner_factory(tmp_path, dtype="bfloat16")
    for prompts in (prompts_factory([7]), prompts_factory([6, 1, 9])):
        greedy_as_the_modules(runner, prompts, monkeypatch)


@one_op_layers
def test_the_modules_run_what_the_one_op_layer_does_not_cover(
    hf_model_factory, runner_factory, prompts_factory, tmp_path, monkeypatch
):
    """Prefill and mixed batches, projection biases (Qwen2), float32 and layers with LoRA
    go through the modules."""
    calls = count_decode_layer_calls(monkeypatch)
    for arch, dtype in (("qwen2", "bfloat16"), ("llama", "float32")):
        path = tmp_path / f"{arch}-{dtype}"
        hf_model_factory(arch).save_pretrained(path)
        prefill_then_decode(runner_factory(path, dtype=dtype), prompts_factory([6, 1]))
    assert calls == []
    hf_model_factory("llama").save_pretrained(tmp_path / "llama")
    runner = runner_factory(tmp_path / "llama", dtype="bfloat16")
    prefill_then_decode(runner, prompts_factory([6, 1]))
    assert len(calls) == runner.model_config.num_hidden_layers  # the decode step only
    calls.clear()
    rows = runner.req_to_token_pool.alloc(2)
    first, second = prompts_factory([3, 4])
    runner.forward(build_forward_batch(runner, [ExtendInput(rows[0], 0, first)]))
    mixed = [ExtendInput(rows[0], len(first), [5]), ExtendInput(rows[1], 0, second)]
    runner.forward(build_forward_batch(runner, mixed))
    assert calls == []
    layer = runner.model.model.layers[0]
    monkeypatch.setattr(layer.mlp.down_proj, "lora", lambda x, y: y)
    assert layer.decode_weights(torch.bfloat16) is None


@pytest.mark.parametrize("arch", ONE_OP_ARCHS)
def test_a_float32_quantized_decode_layer_writes_and_reads_a_float16_pool(
    arch, hf_model_factory, runner_factory, prompts_factory, tmp_path, monkeypatch
):
    """`--kv-cache-dtype float16` under float32 (the AVX2 default over quantized weights):
    the one-op layer rounds the new K/V to half as the modules do, so tokens are theirs and
    logits within float32 rounding of theirs (as over a float32 pool: the modules' float32
    norms and GELU are torch's), and within half's rounding of a float32 pool's. Float
    activations: rounded to integers, x's last-bit differences could move a whole step."""
    hf_model_factory(arch).save_pretrained(tmp_path)
    runner = runner_factory(
        tmp_path,
        dtype="float32",
        quantization="int8",
        quantized_activations="float",
        kv_cache_dtype="float16",
    )
    assert runner.token_to_kv_pool.dtype == torch.float16
    prompts = prompts_factory([6, 1, 9])
    ours = greedy_as_the_modules(runner, prompts, monkeypatch, tolerance=2e-5)
    full_pool = runner_factory(
        tmp_path, dtype="float32", quantization="int8", quantized_activations="float"
    )
    full = run_greedy(full_pool, prompts, 4)
    for our_steps, full_steps in zip(ours.logits, full.logits, strict=True):
        for a, b in zip(our_steps, full_steps, strict=True):
            torch.testing.assert_close(a, b, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_decode_layer_over_block_parts_runs_as_one_op_with_the_modules_results(
    dtype, hf_model_factory, runner_factory, prompts_factory, tmp_path, monkeypatch
):
    """Fused projections held as parts in different block formats (`MIXED_PARTS`): the op
    multiplies each part as the module does, so tokens are the modules' and logits equal to
    theirs bit for bit under bf16 (every kernel is the same), within float32 rounding under
    float32 (the modules' float32 norms are torch's; float activations, since a last-bit
    difference in x can move its rounding to integers by a step). Every kernel path runs
    it."""
    path = tmp_path / "mixed_parts.gguf"
    write_gguf(hf_model_factory("qwen3"), path, quantize=MIXED_PARTS)
    activations = "int16" if dtype == "bfloat16" else "float"
    runner = runner_factory(
        path, dtype=dtype, quantization="gguf", quantized_activations=activations
    )
    assert runner.model.model.layers[0].self_attn.qkv_proj.block_parts
    tolerance = 0.0 if dtype == "bfloat16" else 2e-5
    greedy_as_the_modules(runner, prompts_factory([6, 1, 9]), monkeypatch, tolerance)
