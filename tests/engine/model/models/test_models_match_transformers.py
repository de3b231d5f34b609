"""Our Llama, Qwen2, Qwen3 and Gemma 3 against transformers on the same random weights, in
float64. Gemma 3's prompts run past its 8-token window."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    SiglipVisionConfig,
)

from engine.model.forward_batch import ForwardMode
from testing.batches import ExtendInput, build_forward_batch
from testing.models import GEMMA3_OVERRIDES, TINY_CONFIG
from tests.engine.model.conftest import TINY

ATOL = 1e-6
GEMMA_ATOL = 1e-4
"""transformers' Gemma RMSNorm computes in float32 even in a float64 model: its logits carry
float32 roundings (1e-5 here), where a misplaced tensor moves them by units."""


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


def test_a_multimodal_gemma3_checkpoint_serves_its_text_tower(
    tmp_path, runner_factory, hf_logits, prompts_factory
):
    """Gemma3ForConditionalGeneration's text tower, its vision tower left unloaded, gives
    the whole model's logits for a text-only prompt."""
    text = Gemma3TextConfig(**{**TINY_CONFIG, **GEMMA3_OVERRIDES, **TINY})
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=125,
        eoi_token_index=126,
        image_token_index=127,
    )
    torch.manual_seed(0)
    hf_model = Gemma3ForConditionalGeneration(config).to(torch.float64).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            noise = 0.2 * torch.randn_like(param)
            param.copy_(1 + noise if name.endswith("norm.weight") else noise)
    hf_model.save_pretrained(tmp_path)
    runner = runner_factory(tmp_path)
    prompts = prompts_factory([3, 20], vocab_size=120)
    rows = runner.req_to_token_pool.alloc(len(prompts))
    logits = runner.forward(
        build_forward_batch(runner, [ExtendInput(r, 0, p) for r, p in zip(rows, prompts)])
    )
    for i, prompt in enumerate(prompts):
        assert_logits_match(logits[i], hf_logits(hf_model, prompt), "gemma3")
