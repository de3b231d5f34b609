"""A tiny random-weight Llama saved as a Hugging Face directory, for engine-level tests.

float64 throughout: tiny random models have nearly flat logits, and fp32 rounding alone
would flip greedy tokens between batch layouts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.api import Engine

VOCAB = 256


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(
                1 + 0.2 * torch.randn_like(param)
                if name.endswith("norm.weight")
                else 0.3 * torch.randn_like(param)
            )
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture
def make_engine(tiny_model_dir: Path):
    """`make_engine(**options)`: an Engine on the tiny model, shut down after the test."""
    engines: list[Engine] = []

    def make(**options) -> Engine:
        defaults = dict(
            dtype="float64", device="cpu", skip_tokenizer_init=True, max_total_tokens=8192
        )
        engine = Engine(str(tiny_model_dir), **{**defaults, **options})
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
