"""A batch's sampled tokens on their way to the host, and what the scheduler reads of them.

Why: reading the tokens (`.tolist()`) waits for the device. The forward side instead
starts non-blocking copies into pinned host memory and records an event after them, then
returns at once; the scheduler waits on that event only when it processes the batch —
under the overlap loop, after it has launched the next one. On CPU the tensors already
are host memory and there is no event, but the path is the same.
"""

from __future__ import annotations

import itertools
import time
from typing import NamedTuple, TypeVar

import torch

from engine.model.forward_batch import PromptLogprobsInput
from engine.model.layers.logits_processor import LogitsProcessorOutput
from engine.sampling.sampler import SamplerOutput
from engine.speculative.verify import VerifyOutput

T = TypeVar("T")


class BatchResult(NamedTuple):
    next_token_ids: list[int]
    next_token_logprobs: list[float] | None
    top_logprobs: list[list[tuple[float, int]]] | None
    input_token_logprobs: list[list[float]] | None = None
    """Per request of the batch, the prompt logprobs its rows of this batch gave (see
    `PromptLogprobsInput`); None when no request has any."""
    input_top_logprobs: list[list[list[tuple[float, int]]]] | None = None
    """Per request, per one of those rows, the likeliest (logprob, token id)."""
    verify: VerifyOutput | None = None
    """A verify batch's accepted tokens and paths (`next_token_ids` is each request's last
    token)."""


class PendingResult:
    """The host copies of one batch's outputs, valid once `result` has waited for them."""

    def __init__(
        self,
        sampled: SamplerOutput,
        logits_output: LogitsProcessorOutput | None,
        prompt_logprobs: PromptLogprobsInput | None,
        started: float,
        start_event: torch.cuda.Event | None = None,
        verify: VerifyOutput | None = None,
    ) -> None:
        self.next_token_ids = _to_host(sampled.next_token_ids)
        self.logprobs = _maybe_to_host(sampled.next_token_logprobs)
        self.top_values = _maybe_to_host(sampled.next_token_top_logprobs_val)
        self.top_ids = _maybe_to_host(sampled.next_token_top_logprobs_idx)
        self.rows_per_req = None if prompt_logprobs is None else prompt_logprobs.rows_per_req
        self.input_logprobs = self.input_top_values = self.input_top_ids = None
        self.verify = verify
        if self.rows_per_req is not None and logits_output is not None:
            self.input_logprobs = _maybe_to_host(logits_output.input_token_logprobs)
            self.input_top_values = _maybe_to_host(logits_output.input_top_logprobs_val)
            self.input_top_ids = _maybe_to_host(logits_output.input_top_logprobs_idx)
        self.started = started
        self.start_event = start_event
        self.done_event: torch.cuda.Event | None = None
        self.finished = 0.0
        if start_event is not None:
            self.done_event = torch.cuda.Event(enable_timing=True)
            self.done_event.record()
        else:
            self.finished = time.perf_counter()

    def result(self) -> BatchResult:
        """Wait for the copies, then read them as Python values."""
        if self.done_event is not None:
            self.done_event.synchronize()
        top = None
        if self.top_values is not None:
            top = _pairs(self.top_values, self.top_ids)
        input_logprobs = input_top = None
        if self.rows_per_req is not None and self.input_logprobs is not None:
            input_logprobs = _split(self.input_logprobs.tolist(), self.rows_per_req)
            if self.input_top_values is not None:
                pairs = _pairs(self.input_top_values, self.input_top_ids)
                input_top = _split(pairs, self.rows_per_req)
        return BatchResult(
            self.next_token_ids.tolist(),
            None if self.logprobs is None else self.logprobs.tolist(),
            top,
            input_logprobs,
            input_top,
            self.verify,
        )

    def forward_seconds(self) -> float:
        """How long the forward pass and its sampling took (after `result`)."""
        if self.start_event is not None and self.done_event is not None:
            return self.start_event.elapsed_time(self.done_event) / 1000
        return self.finished - self.started


def _to_host(values: torch.Tensor) -> torch.Tensor:
    if values.device.type == "cpu":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    return host.copy_(values, non_blocking=True)


def _maybe_to_host(values: torch.Tensor | None) -> torch.Tensor | None:
    return None if values is None else _to_host(values)


def _pairs(values: torch.Tensor, ids: torch.Tensor | None) -> list[list[tuple[float, int]]]:
    """[N, K] logprobs and their token ids as N lists of (logprob, token id)."""
    assert ids is not None, "top-k values come with their ids"
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]


def _split(items: list[T], counts: list[int]) -> list[list[T]]:
    """`items` cut into consecutive runs of `counts` items."""
    ends = list(itertools.accumulate(counts))
    return [items[end - n : end] for n, end in zip(counts, ends)]
