"""The embedded SmolLM2-135M-Instruct GGUF, end to end in float32, against transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from engine.model.runner import ModelRunner
from testing.models import embedded_hf_model

CHATS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
]
# Greedy tokens may part ways only where the two best logits are this close: there, the
# order of float32 sums decides, and either token is an honest answer.
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner("embedded", dtype="float32", max_total_tokens=8192, max_running_requests=16)


@pytest.fixture(scope="module")
def chat_prompts(embedded_tokenizer) -> list[list[int]]:
    """Token ids of each chat, rendered with the GGUF's ChatML template."""
    tokenizer = embedded_tokenizer
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": chat}], add_generation_prompt=True, tokenize=False
        )
        for chat in CHATS
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


@pytest.fixture(scope="module")
def hf_model() -> PreTrainedModel:
    return embedded_hf_model()


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy decoding with its KV cache, never stopping at EOS."""
    tokens, input_ids, cache = [], torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids, cache=cache, use_cache=True)
            cache = out.cache
            tokens.append(int(out.logits[0, -1].argmax()))
            input_ids = torch.tensor([tokens[-1:]])
    return tokens


def test_greedy_chat_answers_match_transformers(runner, chat_prompts, hf_model, greedy):
    ours = greedy(runner, chat_prompts, max_new_tokens=24)
    for prompt, tokens in zip(chat_prompts, ours.tokens):
        assert tokens == hf_greedy(hf_model, prompt, 24)


def test_greedy_tokens_alone_equal_those_in_a_batch_of_eight_up_to_near_ties(
    runner, chat_prompts, greedy
):
    prompts = chat_prompts + [
        chat_prompts[0][:5],
        chat_prompts[1] * 3,
        chat_prompts[2][:-7],
        chat_prompts[3][:1],
    ]
    batched = greedy(runner, prompts, max_new_tokens=16)
    for i, prompt in enumerate(prompts):
        alone = greedy(runner, [prompt], max_new_tokens=16)
        for step, (token, batched_token) in enumerate(zip(alone.tokens[0], batched.tokens[i])):
            if token != batched_token:
                logits = alone.logits[0][step]
                gap = (logits[token] - logits[batched_token]).item()
                assert gap < NEAR_TIE, (
                    f"request {i} diverged at step {step} where the top two differ by {gap:.3g}"
                )
                break
