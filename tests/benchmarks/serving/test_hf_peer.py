"""The transformers peer: static batches in workload order, exactly the asked number of
tokens even from a model that wants to stop, and batch-level timing."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from benchmarks.serving.hf_peer import HFGeneratePeer, static_batches
from benchmarks.serving.workloads import BenchRequest, WorkloadConfig, build
from testing.models import TINY_CONFIG, tiny_hf_model

EOS = TINY_CONFIG["eos_token_id"]


def test_static_batches_take_requests_in_order_size_at_a_time():
    requests = [BenchRequest([i], 1) for i in range(7)]
    assert static_batches(requests, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert static_batches(requests, 10) == [list(range(7))]


def test_a_turn_never_shares_a_batch_with_the_turn_it_continues():
    requests = build("multi-turn", WorkloadConfig(requests=6, turns=3, user_len=2, output_len=2))
    batches = static_batches(requests, 4)
    assert batches == [[0, 1], [2, 3], [4, 5]]
    for batch in batches:
        assert not any(requests[i].after in batch for i in batch)


class AlwaysEOS(nn.Module):
    """An output head whose greedy choice is always EOS."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*hidden.shape[:-1], self.vocab_size, dtype=hidden.dtype)
        logits[..., EOS] = 1.0
        return logits


def tiny_eager_model() -> PreTrainedModel:
    """The tiny Llama with an output head that always answers EOS."""
    model = tiny_hf_model(tie_word_embeddings=False)
    model.lm_head = AlwaysEOS(model.config.vocab_size)
    return model


def test_every_request_gets_its_output_len_even_when_the_model_says_eos():
    peer = HFGeneratePeer(tiny_eager_model())
    batch = [BenchRequest([5, 6, 7], 5), BenchRequest([8, 9], 3), BenchRequest([10], 1)]
    results = peer.run_batch(batch)
    assert [r.output_len for r in results] == [5, 3, 1]
    assert [len(r.itls) for r in results] == [4, 2, 0]
    assert len({r.ttft for r in results}) == 1  # the batch's first token
    for request, r in zip(batch, results):
        assert r.prompt_len == len(request.prompt) and r.error is None
        assert 0 < r.ttft <= r.latency
        assert r.latency == pytest.approx(
            r.ttft + sum(r.itls)
        )  # its own last token, not the batch's
    assert results[2].latency <= results[1].latency <= results[0].latency


def test_run_returns_results_in_workload_order_and_the_wall_time():
    peer = HFGeneratePeer(tiny_eager_model())
    requests = [BenchRequest([100 + i] * (1 + i), 2) for i in range(5)]
    results, duration = peer.run(requests, concurrency=2)
    assert [r.prompt_len for r in results] == [1, 2, 3, 4, 5]
    assert duration >= max(r.latency for r in results)
