"""Batches built by hand, for tests and benchmarks that drive a `ModelRunner` or the sampler
without a scheduler (the scheduler builds its batches from its own bookkeeping,
`engine/sched/batch.py`)."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch

from engine.model.forward_batch import ForwardBatch, ForwardMode
from engine.model.runner import ModelRunner
from engine.sampling.sampling_batch_info import SamplingBatchInfo, SamplingReq, SamplingRows


class ExtendInput(NamedTuple):
    """One request's part of a batch: `input_ids` are new tokens to place after the
    `prefix_len` tokens its `req_to_token` row already maps."""

    req_pool_idx: int
    prefix_len: int
    input_ids: Sequence[int]


def build_forward_batch(
    runner: ModelRunner, reqs: Sequence[ExtendInput], forward_mode: ForwardMode | None = None
) -> ForwardBatch:
    """Allocate KV slots in `runner`'s pool for the new tokens, point each request's
    `req_to_token` row at them, and lay the batch out as tensors. The default mode is
    DECODE when every request adds one token, else EXTEND."""
    allocator = runner.token_to_kv_pool_allocator
    extend_lens = [len(req.input_ids) for req in reqs]
    out_cache_loc = allocator.alloc(sum(extend_lens))
    if out_cache_loc is None:
        raise RuntimeError(
            f"the KV pool has {allocator.available_size()} free slots, "
            f"the batch needs {sum(extend_lens)}"
        )
    start = 0
    for req, extend_len in zip(reqs, extend_lens):
        runner.req_to_token_pool.write(
            req.req_pool_idx, req.prefix_len, out_cache_loc[start : start + extend_len]
        )
        start += extend_len
    if forward_mode is None:
        forward_mode = (
            ForwardMode.DECODE if all(e == 1 for e in extend_lens) else ForwardMode.EXTEND
        )

    def host(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return ForwardBatch.from_host(
        forward_mode,
        host(list(itertools.chain.from_iterable(req.input_ids for req in reqs))),
        host([req.req_pool_idx for req in reqs]),
        host([req.prefix_len for req in reqs]),
        host(extend_lens),
        out_cache_loc,
        runner.req_to_token_pool,
        runner.token_to_kv_pool,
    )


def sampling_batch_info(
    reqs: Sequence[SamplingReq],
    vocab_size: int,
    eos_token_ids: Collection[int],
    device: torch.device | str = "cpu",
) -> SamplingBatchInfo:
    """Lay out `reqs`' sampling parameters as `ScheduleBatch` does for a new batch;
    `eos_token_ids` are the model's end-of-sequence ids, masked with each request's
    `stop_token_ids` until it has `min_new_tokens` outputs."""
    rows = SamplingRows.from_params([req.sampling_params for req in reqs], vocab_size)
    info = SamplingBatchInfo.from_rows(rows, vocab_size, device)
    if bool(rows.needs_req_state.any()):
        info.add_req_state(reqs, rows, eos_token_ids)
    return info
