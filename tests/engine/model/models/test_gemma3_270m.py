"""The embedded Gemma 3 270M GGUF end to end in float32 (its blocks dequantized at load)
against transformers' `Gemma3ForCausalLM` read from the same file: logits over prompts of
more than 1,500 tokens, where 15 of its 18 layers see only the last 512, and greedy answers."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from engine.model.embedded import GEMMA3_MODEL
from engine.model.runner import ModelRunner
from engine.model.tokenizer_cache import load_tokenizer
from testing.batches import ExtendInput, build_forward_batch
from testing.models import embedded_hf_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]
LONG_PROMPT_TOKENS = (1600, 2100)
ATOL = 2e-3
"""Logits reach about 30; the two sum 262k-wide float32 products in different orders."""


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(GEMMA3_MODEL, dtype="float32", max_total_tokens=8192, max_running_requests=8)


@pytest.fixture(scope="module")
def hf_model() -> PreTrainedModel:
    return embedded_hf_model(GEMMA3_MODEL)


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    """Real text (this repository's README) cut to each length, after <bos>."""
    tokenizer = load_tokenizer(GEMMA3_MODEL)
    text = open("README.md").read() * 4
    ids = tokenizer(text).input_ids
    return [ids[:n] for n in LONG_PROMPT_TOKENS]


def hf_next_logits(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]


def test_logits_past_the_window_match_transformers(runner, hf_model, long_prompts):
    rows = runner.req_to_token_pool.alloc(len(long_prompts))
    ours = runner.forward(
        build_forward_batch(runner, [ExtendInput(r, 0, p) for r, p in zip(rows, long_prompts)])
    )
    for row, prompt in zip(rows, long_prompts):
        slots = runner.req_to_token_pool.req_to_token[row, : len(prompt)].long()
        runner.token_to_kv_pool_allocator.free(slots)
    runner.req_to_token_pool.free(rows)
    for i, prompt in enumerate(long_prompts):
        torch.testing.assert_close(ours[i], hf_next_logits(hf_model, prompt), atol=ATOL, rtol=0)


def test_greedy_answers_match_transformers(runner, hf_model, greedy):
    tokenizer = load_tokenizer(GEMMA3_MODEL)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    ours = greedy(runner, prompts, max_new_tokens=16)
    for prompt, tokens in zip(prompts, ours.tokens):
        with torch.no_grad():
            theirs = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None
            )[0, len(prompt) :].tolist()
        assert tokens == theirs
