"""The CPU decode step compiled by torch.compile (`enable_torch_compile`): the logits and
greedy tokens of eager decode with one compile at start and none while the context grows,
attention being one opaque op sized by the context at run time. One bucket: a compile
costs tens of seconds on two cores; bucket choice and padding are the GraphRunner's, tested
with the fake backend in test_graph_runner.py."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from engine.model.graph_runner import TorchCompileBackend


def test_compiled_decode_equals_eager_over_growing_contexts(
    tmp_path, monkeypatch, hf_model_factory, runner_factory, greedy, prompts_factory
):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    hf_model_factory("llama", num_hidden_layers=1).save_pretrained(tmp_path / "model")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = runner_factory(
        tmp_path / "model", dtype="float32", enable_torch_compile=True, torch_compile_max_bs=1
    )
    eager = runner_factory(tmp_path / "model", dtype="float32")
    graph_runner = compiled.graph_runner
    assert graph_runner is not None and isinstance(graph_runner.backend, TorchCompileBackend)
    assert graph_runner.batch_sizes == [1]
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiles == 1  # at start
    for lengths, seed in (([7], 1), ([12], 2)):
        prompts = prompts_factory(lengths, seed=seed)
        from_compiled = greedy(compiled, prompts, max_new_tokens=6)
        from_eager = greedy(eager, prompts, max_new_tokens=6)
        assert from_compiled.tokens == from_eager.tokens
        for ours, theirs in zip(from_compiled.logits, from_eager.logits):
            torch.testing.assert_close(torch.stack(ours), torch.stack(theirs), atol=1e-5, rtol=1e-5)
    # the context grew every step, and the second prompt started longer: no recompile
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles


def test_torch_compile_is_refused_off_cpu(tmp_path, hf_model_factory, runner_factory):
    hf_model_factory("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="CUDA graphs"):
        runner_factory(tmp_path, device="cuda", enable_torch_compile=True)
