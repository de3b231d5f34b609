"""Hugging Face transformers `generate` as a benchmark peer: static batches, timed as a
closed-loop client would time them.

The model is transformers' `LlamaForCausalLM` holding exactly the weights radixserve
serves (the embedded GGUF as radixserve's loader dequantizes it; see
`benchmarks/model_bench.py:hf_model`), in the same dtype: a comparison of runtimes, not
of checkpoints. SDPA attention, `DynamicCache`, greedy, no EOS stop.

Semantics, so that its figures read like a server's at the same concurrency C:
- the workload is cut, in order, into batches of C requests (cut earlier where a
  multi-turn request depends on one in the batch), left-padded, and run one after the
  other: batch b starts when batch b-1 finished, as C slots freed at once would;
- every request of a batch is "sent" when the batch starts: its TTFT is the time from
  the batch's start to the batch's first token (the prefill of the whole padded batch);
  its ITLs are the batch's decode steps; its end-to-end latency ends at its own last token;
- request rate mode does not exist for this peer (static batching has no arrivals).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from benchmarks.serving.metrics import RequestResult
from benchmarks.serving.workloads import BenchRequest

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PAD_ID = 0
"""Left padding; masked out, so its value does not matter."""


def static_batches(requests: Sequence[BenchRequest], size: int) -> list[list[int]]:
    """Indices of `requests` in order, `size` at a time, cut early before a request whose
    `after` is in the batch being filled (it cannot run beside the turn it continues)."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i, request in enumerate(requests):
        if len(current) == size or (request.after is not None and request.after in current):
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


class StepClock(BaseStreamer):
    """`generate` hands a streamer the prompt, then each step's new tokens, already copied
    to the CPU (a device sync): the times of those calls are when each step's tokens existed."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFGeneratePeer:
    def __init__(self, model: PreTrainedModel):
        self.model = model
        # `generate` fills a None in the config it is given from the model's own, so "no
        # EOS stop" has to be said here (ignore_eos, as the servers are asked).
        model.generation_config.eos_token_id = None

    @classmethod
    def embedded(cls, dtype: str, device: str = "cpu") -> HFGeneratePeer:
        """The embedded SmolLM2 with radixserve's weights, in `dtype`, on `device`."""
        from benchmarks.model_bench import hf_model

        return cls(hf_model(DTYPES[dtype]).to(device))

    def run_batch(self, batch: Sequence[BenchRequest]) -> list[RequestResult]:
        width = max(len(r.prompt) for r in batch)
        device = self.model.device
        input_ids = torch.tensor(
            [[PAD_ID] * (width - len(r.prompt)) + r.prompt for r in batch], device=device
        )
        attention_mask = torch.tensor(
            [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=device
        )
        steps = max(r.output_len for r in batch)
        config = GenerationConfig(max_new_tokens=steps, do_sample=False, pad_token_id=PAD_ID)
        clock = StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                streamer=clock,
            )
        token_times = clock.times[1:]  # [0] is the prompt
        if len(token_times) != steps:
            raise RuntimeError(f"generate produced {len(token_times)} steps, {steps} were asked")
        gaps = [b - a for a, b in zip(token_times, token_times[1:])]
        return [
            RequestResult(
                prompt_len=len(r.prompt),
                output_len=r.output_len,
                ttft=token_times[0] - start,
                itls=gaps[: r.output_len - 1],
                latency=token_times[r.output_len - 1] - start,
            )
            for r in batch
        ]

    def run(
        self, requests: Sequence[BenchRequest], concurrency: int
    ) -> tuple[list[RequestResult], float]:
        """Per-request results in workload order, and the run's wall time."""
        results: list[RequestResult | None] = [None] * len(requests)
        start = time.perf_counter()
        for batch in static_batches(requests, concurrency):
            for i, result in zip(batch, self.run_batch([requests[i] for i in batch])):
                results[i] = result
        return [r for r in results if r is not None], time.perf_counter() - start
