"""Builders shared by the sampler tests: requests without a scheduler, batches without a model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch

from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.sampling.sampling_params import SamplingParams
from testing.batches import sampling_batch_info


@dataclass
class FakeReq:
    """The three fields `sampling_batch_info` reads from the scheduler's `Req`."""

    sampling_params: SamplingParams
    origin_input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


@pytest.fixture
def make_info() -> Callable[..., SamplingBatchInfo]:
    """`make_info(params, vocab_size, prompts=..., outputs=..., eos_token_ids=...)`, with
    every `SamplingParams` verified first so that no test samples with invalid values."""

    def make(
        params: Sequence[SamplingParams],
        vocab_size: int,
        prompts: Sequence[list[int]] | None = None,
        outputs: Sequence[list[int]] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> SamplingBatchInfo:
        for p in params:
            p.verify(vocab_size)
        reqs = [
            FakeReq(p, list(prompts[i]) if prompts else [], list(outputs[i]) if outputs else [])
            for i, p in enumerate(params)
        ]
        return sampling_batch_info(reqs, vocab_size, eos_token_ids)

    return make


@pytest.fixture(autouse=True)
def _seed_global_generator() -> None:
    """Unseeded draws come from torch's global generator: fix it so a run is repeatable."""
    torch.manual_seed(0)
