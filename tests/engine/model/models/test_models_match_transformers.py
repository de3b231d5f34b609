"""Our Llama, Qwen2, Qwen3 and Gemma 3 against transformers on the same random weights, in
float64. Gemma 3's prompts run past its 8-token window."""

from __future__ import annotations

import torch

from engine.model.forward_batch import ForwardMode
from testing.batches import ExtendInput, build_forward_batch

ATOL = 1e-6
GEMMA_ATOL = 1e-5
"""transformers' Gemma RMSNorm computes in float32 even in a float64 model."""


def assert_logits_match(ours: torch.Tensor, expected: torch.Tensor, model_type: str) -> None:
    assert ours.dtype == torch.float64
    atol = GEMMA_ATOL if model_type.startswith("gemma") else ATOL
    diff = (ours - expected).abs().max().item()
    assert diff <= atol, f"max abs diff {diff:.3g} > {atol}"


def test_prefill_of_a_ragged_batch_matches_transformers(tiny, hf_logits, prompts_factory):
    hf_model, runner = tiny
    prompts = prompts_factory([1, 5, 17, 40, 2])
    rows = runner.req_to_token_pool.alloc(len(prompts))
    logits = runner.forward(
        build_forward_batch(runner, [ExtendInput(r, 0, p) for r, p in zip(rows, prompts)])
    )
    assert logits.shape == (len(prompts), hf_model.config.vocab_size)
    for i, prompt in enumerate(prompts):
        assert_logits_match(logits[i], hf_logits(hf_model, prompt), hf_model.config.model_type)


def test_decode_steps_after_prefill_match_transformers(tiny, hf_logits, greedy, prompts_factory):
    hf_model, runner = tiny
    prompts = prompts_factory([3, 30, 11])
    result = greedy(runner, prompts, max_new_tokens=8)
    for prompt, tokens, step_logits in zip(prompts, result.tokens, result.logits):
        for step, logits in enumerate(step_logits):
            assert_logits_match(
                logits, hf_logits(hf_model, prompt + tokens[:step]), hf_model.config.model_type
            )


def test_prefill_split_in_two_reads_the_prefix_from_the_pool(tiny, hf_logits, prompts_factory):
    hf_model, runner = tiny
    prompts = prompts_factory([50, 23, 9], seed=1)
    splits = [31, 1, 8]
    rows = runner.req_to_token_pool.alloc(len(prompts))
    runner.forward(
        build_forward_batch(
            runner, [ExtendInput(r, 0, p[:s]) for r, p, s in zip(rows, prompts, splits)]
        )
    )
    logits = runner.forward(
        build_forward_batch(
            runner, [ExtendInput(r, s, p[s:]) for r, p, s in zip(rows, prompts, splits)]
        )
    )
    for i, prompt in enumerate(prompts):
        assert_logits_match(logits[i], hf_logits(hf_model, prompt), hf_model.config.model_type)


def test_mixed_batch_of_extends_and_decodes_matches_transformers(tiny, hf_logits, prompts_factory):
    hf_model, runner = tiny
    prompts = prompts_factory([12, 7, 25, 4], seed=2)
    rows = runner.req_to_token_pool.alloc(len(prompts))
    # Requests 2 and 3 are already decoding; 0 and 1 start (or continue) their prefill.
    runner.forward(
        build_forward_batch(runner, [ExtendInput(rows[i], 0, prompts[i][:-1]) for i in (1, 2, 3)])
    )
    batch = [
        ExtendInput(rows[0], 0, prompts[0]),
        ExtendInput(rows[1], len(prompts[1]) - 1, prompts[1][-1:]),
        ExtendInput(rows[2], len(prompts[2]) - 1, prompts[2][-1:]),
        ExtendInput(rows[3], len(prompts[3]) - 1, prompts[3][-1:]),
    ]
    logits = runner.forward(build_forward_batch(runner, batch, ForwardMode.MIXED))
    for i, prompt in enumerate(prompts):
        assert_logits_match(logits[i], hf_logits(hf_model, prompt), hf_model.config.model_type)
