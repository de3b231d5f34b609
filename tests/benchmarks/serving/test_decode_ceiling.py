"""The decode ceiling counts the bytes a step must read: every weight (the output
projection whole, an untied input embedding not) and every request's KV."""

from __future__ import annotations

import pytest

from benchmarks.serving.decode_ceiling import ceiling, decode_params, kv_bytes_per_token
from engine.model.config import ModelConfig
from testing.models import tiny_hf_model

SMOLLM2_135M = ModelConfig(
    architecture="LlamaForCausalLM",
    num_hidden_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    context_len=8192,
    tie_word_embeddings=True,
)


@pytest.mark.parametrize("tied", [True, False])
def test_decode_params_are_the_models_parameters_less_an_untied_embedding(tied: bool):
    model = tiny_hf_model(
        vocab_size=97,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
    )
    total = sum(p.numel() for p in model.parameters())  # a tied matrix is counted once
    config = ModelConfig.from_hf(model.config.to_dict())
    assert decode_params(config) == total - (0 if tied else 97 * 24)


def test_smollm2_at_batch_32_and_512_tokens_is_about_1300_tokens_per_second_at_27_gbs():
    assert kv_bytes_per_token(SMOLLM2_135M, 2) == 30 * 2 * 3 * 64 * 2
    bound = ceiling(SMOLLM2_135M, batch=32, context=512, dtype_bytes=2, bandwidth_gbs=27.0)
    assert bound.weight_bytes == pytest.approx(269e6, rel=0.01)
    assert bound.kv_bytes == 32 * 512 * 23040
    assert bound.step_ms == pytest.approx((bound.weight_bytes + bound.kv_bytes) / 27e9 * 1000)
    assert bound.tokens_per_s == pytest.approx(1336, rel=0.01)
