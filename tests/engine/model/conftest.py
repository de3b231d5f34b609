"""Tiny random-weight models with transformers as the oracle, and a greedy loop over our runner.

Tiny models run in float64: their logits are nearly flat, so float32 rounding alone would
flip greedy tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.model.runner import ModelRunner
from engine.model.tokenizer_cache import load_tokenizer
from testing.batches import ExtendInput, build_forward_batch
from testing.models import TINY_ARCHS, tiny_hf_model

TINY = dict(vocab_size=128, intermediate_size=96, max_position_embeddings=256)
"""The model tests' sizes over the shared tiny config: a 128-token vocabulary and a
256-token context, which the runner's pool shapes are checked against."""


def make_hf_model(arch: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A transformers model of a TINY_ARCHS variant in float64, its weights drawn at 0.2
    N(0, 1): the scale these tests' tolerances hold for."""
    return tiny_hf_model(
        arch, seed=seed, dtype=torch.float64, weight_scale=0.2, **{**TINY, **overrides}
    )


def hf_last_logits(model: PreTrainedModel, token_ids: Sequence[int]) -> torch.Tensor:
    """The oracle: transformers' logits for the token after `token_ids`, no cache."""
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0, -1]


def tiny_runner(path: Path | str, **kwargs) -> ModelRunner:
    """A float64 runner with a small KV pool, unless `kwargs` say otherwise."""
    return ModelRunner(
        str(path),
        **{"dtype": "float64", "max_total_tokens": 4096, "max_running_requests": 16, **kwargs},
    )


def random_prompts(
    lengths: Sequence[int], vocab_size: int = TINY["vocab_size"], seed: int = 0
) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@dataclass
class GreedyResult:
    tokens: list[list[int]]
    logits: list[list[torch.Tensor]]  # per request, per step: the logits the token was taken from


def run_greedy(
    runner: ModelRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> GreedyResult:
    """Prefill every prompt in one EXTEND batch, then decode them together, taking the
    argmax each step (the sampler is not under test here). Frees rows and slots after."""
    rows = runner.req_to_token_pool.alloc(len(prompts))
    result = GreedyResult([[] for _ in prompts], [[] for _ in prompts])
    batch = [ExtendInput(row, 0, list(prompt)) for row, prompt in zip(rows, prompts)]
    for _ in range(max_new_tokens):
        logits = runner.forward(build_forward_batch(runner, batch))
        next_tokens = logits.argmax(-1).tolist()
        for i, token in enumerate(next_tokens):
            result.tokens[i].append(token)
            result.logits[i].append(logits[i])
        batch = [
            ExtendInput(req.req_pool_idx, req.prefix_len + len(req.input_ids), [token])
            for req, token in zip(batch, next_tokens)
        ]
    for req in batch:
        runner.token_to_kv_pool_allocator.free(
            runner.req_to_token_pool.req_to_token[req.req_pool_idx, : req.prefix_len].long()
        )
    runner.req_to_token_pool.free(rows)
    return result


@pytest.fixture
def greedy() -> Callable[[ModelRunner, Sequence[Sequence[int]], int], GreedyResult]:
    return run_greedy


@pytest.fixture(params=list(TINY_ARCHS))
def tiny(request, tmp_path) -> tuple[PreTrainedModel, ModelRunner]:
    """(transformers model, our runner on the same weights saved as sharded safetensors)."""
    hf_model = make_hf_model(request.param)
    hf_model.save_pretrained(tmp_path, max_shard_size="50KB")
    return hf_model, tiny_runner(tmp_path)


@pytest.fixture
def hf_model_factory() -> Callable[..., PreTrainedModel]:
    """`hf_model_factory(arch, seed=0, **config_overrides)`: see make_hf_model."""
    return make_hf_model


@pytest.fixture
def hf_logits() -> Callable[[PreTrainedModel, Sequence[int]], torch.Tensor]:
    return hf_last_logits


@pytest.fixture
def runner_factory() -> Callable[..., ModelRunner]:
    """`runner_factory(path, **runner_kwargs)`: see tiny_runner."""
    return tiny_runner


@pytest.fixture
def prompts_factory() -> Callable[..., list[list[int]]]:
    """`prompts_factory(lengths, vocab_size=128, seed=0)`: random token ids."""
    return random_prompts


@pytest.fixture(scope="session")
def embedded_tokenizer() -> PreTrainedTokenizerBase:
    """Built once: transformers takes seconds to build it from the GGUF."""
    return load_tokenizer("embedded")
