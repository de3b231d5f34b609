"""ModelRunner: memory ownership, batch layout, and batch invariance on tiny float64 models."""

from __future__ import annotations

import pytest
import torch

from engine.mem.kv_pool import MHATokenToKVPool
from engine.model.forward_batch import ForwardMode
from engine.model.runner import DEFAULT_CPU_KV_CACHE_BYTES
from testing.batches import ExtendInput, build_forward_batch


@pytest.fixture
def llama_dir(tmp_path, hf_model_factory):
    """The model tests' tiny Llama (128-token vocabulary) saved to a folder."""
    hf_model_factory("llama").save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_alone_equal_those_in_a_batch_of_eight(
    arch, tmp_path, hf_model_factory, runner_factory, greedy, prompts_factory
):
    hf_model_factory(arch).save_pretrained(tmp_path)
    runner = runner_factory(tmp_path)
    prompts = prompts_factory([1, 9, 33, 4, 60, 17, 2, 41], seed=3)
    batched = greedy(runner, prompts, max_new_tokens=10)
    for i, prompt in enumerate(prompts):
        alone = greedy(runner, [prompt], max_new_tokens=10)
        assert alone.tokens[0] == batched.tokens[i]
        torch.testing.assert_close(
            torch.stack(alone.logits[0]), torch.stack(batched.logits[i]), atol=1e-12, rtol=0
        )


def test_build_forward_batch_lays_out_tokens_and_points_rows_at_new_slots(
    llama_dir, runner_factory
):
    runner = runner_factory(llama_dir)
    rows = runner.req_to_token_pool.alloc(2)
    fb = build_forward_batch(
        runner, [ExtendInput(rows[0], 0, [5, 6, 7]), ExtendInput(rows[1], 4, [9])]
    )
    assert fb.forward_mode is ForwardMode.EXTEND
    assert fb.input_ids.tolist() == [5, 6, 7, 9]
    assert fb.positions.tolist() == [0, 1, 2, 4]
    assert (fb.seq_lens_cpu, fb.prefix_lens_cpu, fb.extend_lens_cpu) == ([3, 5], [0, 4], [3, 1])
    table = runner.req_to_token_pool.req_to_token
    assert table[rows[0], :3].tolist() == fb.out_cache_loc[:3].tolist()
    assert table[rows[1], 4].item() == fb.out_cache_loc[3].item()
    assert (
        build_forward_batch(runner, [ExtendInput(rows[1], 5, [3])]).forward_mode
        is ForwardMode.DECODE
    )


def test_build_forward_batch_fails_clearly_when_the_pool_is_full(llama_dir, runner_factory):
    runner = runner_factory(llama_dir, max_total_tokens=8)
    row = runner.req_to_token_pool.alloc(1)[0]
    with pytest.raises(RuntimeError, match="8 free slots, the batch needs 9"):
        build_forward_batch(runner, [ExtendInput(row, 0, list(range(9)))])


def test_kv_pool_is_sized_from_max_total_tokens_or_the_cpu_budget(llama_dir, runner_factory):
    runner = runner_factory(llama_dir)
    assert runner.max_total_num_tokens == 4096
    assert runner.token_to_kv_pool.k_buffer[0].shape == (4097, 2, 16)
    assert runner.req_to_token_pool.req_to_token.shape == (17, 256)
    budget_runner = runner_factory(llama_dir, max_total_tokens=None, context_len=64)
    expected = MHATokenToKVPool.max_tokens_for_budget(
        DEFAULT_CPU_KV_CACHE_BYTES, 2, 16, 2, torch.float64
    )
    assert budget_runner.max_total_num_tokens == expected
    assert budget_runner.req_to_token_pool.max_context_len == 64


def test_bfloat16_runner_returns_float32_logits_close_to_float64(
    llama_dir, runner_factory, prompts_factory
):
    prompt = prompts_factory([20])[0]
    logits = {}
    for dtype in ("bfloat16", "float64"):
        runner = runner_factory(llama_dir, dtype=dtype)
        row = runner.req_to_token_pool.alloc(1)[0]
        logits[dtype] = runner.forward(build_forward_batch(runner, [ExtendInput(row, 0, prompt)]))
    assert logits["bfloat16"].dtype == torch.float32
    assert (logits["bfloat16"].double() - logits["float64"]).abs().max() < 0.15 * logits[
        "float64"
    ].abs().max()


def test_unsupported_dtype_for_the_device_is_rejected(llama_dir, runner_factory):
    with pytest.raises(ValueError, match="float16 is not supported on cpu"):
        runner_factory(llama_dir, dtype="float16")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_runner_matches_cpu_float64_greedy_tokens(
    llama_dir, runner_factory, greedy, prompts_factory
):
    prompts = prompts_factory([7, 30, 2])
    on_cpu = greedy(runner_factory(llama_dir), prompts, max_new_tokens=8)
    on_cuda = greedy(
        runner_factory(llama_dir, dtype="bfloat16", device="cuda", mem_fraction_static=0.5),
        prompts,
        max_new_tokens=8,
    )
    for cpu_logits, cuda_logits in zip(on_cpu.logits, on_cuda.logits):
        assert (
            torch.stack(cpu_logits) - torch.stack(cuda_logits).double().cpu()
        ).abs().max() < 0.15 * torch.stack(cpu_logits).abs().max()
