"""The decoder's fused steps: the Triton kernels give the torch path's logits (run on CPU
under Triton's interpreter), and the torch path stays short per layer on CPU, where every
op costs its dispatch at decode sizes."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.model import layers
from engine.model.layers.radix_attention import RadixAttention
from engine.model.runner import ExtendInput, ModelRunner

MAX_OPS_PER_LAYER = 22
"""Ops one decoder layer dispatches outside attention on CPU in bf16: 57 before the fusions
(75 with the torch backend's attention)."""


def prefill_then_decode(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    rows = runner.req_to_token_pool.alloc(len(prompts))
    prefill = runner.forward(
        runner.build_forward_batch([ExtendInput(r, 0, p) for r, p in zip(rows, prompts)])
    )
    decode = runner.forward(
        runner.build_forward_batch([ExtendInput(r, len(p), [5]) for r, p in zip(rows, prompts)])
    )
    return [prefill, decode]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k norms before rotary
def test_triton_kernels_give_the_torch_paths_logits(
    arch, hf_model_factory, runner_factory, prompts_factory, tmp_path, monkeypatch
):
    hf_model_factory(arch).save_pretrained(tmp_path)
    runner = runner_factory(tmp_path, dtype="float32")
    prompts = prompts_factory([6, 1, 9])
    expected = prefill_then_decode(runner, prompts)
    monkeypatch.setattr(layers, "uses_triton", lambda x: True)
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
