"""The CPU decode step compiled by torch.compile (`enable_torch_compile`): the logits and
greedy tokens of eager decode, bucket padding included, with one compile per bucket and
none while decoding, and attention as one opaque op sized by the longest context."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from engine.model.graph_runner import TorchCompileBackend


def test_compiled_decode_equals_eager_over_growing_contexts_and_padded_buckets(
    tmp_path, monkeypatch, hf_model_factory, runner_factory, greedy, prompts_factory
):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    hf_model_factory("llama", num_hidden_layers=1).save_pretrained(tmp_path / "model")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = runner_factory(
        tmp_path / "model", dtype="float32", enable_torch_compile=True, torch_compile_max_bs=2
    )
    eager = runner_factory(tmp_path / "model", dtype="float32")
    graph_runner = compiled.graph_runner
    assert graph_runner is not None and isinstance(graph_runner.backend, TorchCompileBackend)
    assert graph_runner.batch_sizes == [1, 2]
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiles == 2  # one per bucket, at start
    for lengths, seed in (([7], 1), ([3, 12], 2)):  # batch 1 exactly; batch 2 with ragged contexts
        prompts = prompts_factory(lengths, seed=seed)
        from_compiled = greedy(compiled, prompts, max_new_tokens=5)
        from_eager = greedy(eager, prompts, max_new_tokens=5)
        assert from_compiled.tokens == from_eager.tokens
        for ours, theirs in zip(from_compiled.logits, from_eager.logits):
            torch.testing.assert_close(torch.stack(ours), torch.stack(theirs), atol=1e-5, rtol=1e-5)
    # contexts grew every step and batch 1 ran in bucket 2 as well: no recompile
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles


def test_torch_compile_is_refused_off_cpu(tmp_path, hf_model_factory, runner_factory):
    hf_model_factory("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="CUDA graphs"):
        runner_factory(tmp_path, device="cuda", enable_torch_compile=True)
