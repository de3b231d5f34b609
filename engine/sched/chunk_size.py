"""The default chunk of a chunked prefill, per device.

A turn that runs long holds everything the loop does between turns: new requests, aborts
of dropped ones and the decode steps of running requests all wait for it. A chunk's cost
grows with its prefix (attention reads every earlier token), so the longest turn is the
last chunk of a full-context prompt. On a CPU a chunk of 256 keeps that last turn near a
second where a chunk of 4,096 holds the loop for tens of seconds (measured in
docs/benchmarks/turns.md); on CUDA a turn of 4,096 takes milliseconds.
"""

from __future__ import annotations

import torch

CPU_CHUNKED_PREFILL_SIZE = 256
CUDA_CHUNKED_PREFILL_SIZE = 4096


def resolve_chunked_prefill_size(requested: int | None, device: torch.device) -> int | None:
    """`--chunked-prefill-size` as given (None: off), or for 0 the device's default."""
    if requested != 0:
        return requested
    return CUDA_CHUNKED_PREFILL_SIZE if device.type == "cuda" else CPU_CHUNKED_PREFILL_SIZE
