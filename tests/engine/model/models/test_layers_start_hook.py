"""The model tells whoever set `ForwardBatch.on_layers_start` (the CPU overlap loop's forward
thread) when its forward enters the layers: once per forward, after the embedding and the
rotary lookup, before the first layer, in prefill and in decode, modules or one-op layers."""

from __future__ import annotations

import pytest
import torch

from testing.batches import ExtendInput, build_forward_batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the one-op decode layer
def test_the_hook_runs_once_between_the_embedding_and_the_first_layer(
    dtype, hf_model_factory, runner_factory, tmp_path
):
    hf_model_factory("llama").save_pretrained(tmp_path)
    runner = runner_factory(tmp_path, dtype=dtype)
    model = runner.model.model
    events: list[str] = []
    model.embed_tokens.register_forward_hook(lambda *args: events.append("embedding"))
    model.layers[0].register_forward_pre_hook(lambda *args: events.append("layer 0"))

    rows = runner.req_to_token_pool.alloc(2)
    prompts = [[3, 4, 5], [6, 7]]
    for batch in (
        [ExtendInput(r, 0, p) for r, p in zip(rows, prompts)],
        [ExtendInput(r, len(p), [8]) for r, p in zip(rows, prompts)],
    ):
        forward_batch = build_forward_batch(runner, batch)
        forward_batch.on_layers_start = lambda: events.append("layers start")
        logits = runner.forward(forward_batch)
        assert torch.isfinite(logits).all()
        assert events == ["embedding", "layers start", "layer 0"]
        events.clear()
