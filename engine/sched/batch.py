"""ScheduleBatch: the scheduler's view of one forward pass, and its layout as tensors."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from engine.mem.swa_kv_pool import KVPool
from engine.model.forward_batch import ForwardBatch, ForwardMode, PromptLogprobsInput
from engine.sampling.sampling_batch_info import SamplingBatchInfo, SamplingRows
from engine.sched.cache_manager import CacheManager, req_row
from engine.sched.mask_filler import MaskFiller, MaskRow, PendingMask
from engine.sched.req import Req
from engine.sched.running_batch import RunningBatch
from engine.speculative.draft_tree import DraftTree


@dataclass
class ScheduleBatch:
    """Requests of one forward pass — prefills (`extend_reqs`) first, then decodes — with
    the tensors the forward side needs. The batch owns its tensors: nothing the scheduler
    does to the pools afterwards changes what this batch reads."""

    reqs: list[Req]
    extend_lens: list[int]
    num_extend_reqs: int
    chunked: frozenset[int]
    """`id`s of requests whose prefill continues after this batch: they sample nothing."""
    forward_batch: ForwardBatch
    sampling_info: SamplingBatchInfo
    faults: list[tuple[Req, Exception]] = field(default_factory=list)
    """Requests whose grammar raised or ran over its budget while masking this batch's row,
    with the error: the scheduler fails each alone when it processes the batch (its
    sampled token is void)."""
    pending_mask: PendingMask | None = None
    """The grammar bitmask, filling beside the forward until `resolve_vocab_mask`."""
    trees: list[DraftTree] | None = None
    """TARGET_VERIFY: each request's draft tree, whose nodes are its rows."""

    @property
    def forward_mode(self) -> ForwardMode:
        return self.forward_batch.forward_mode

    def resolve_vocab_mask(self) -> None:
        """Wait for the grammar bitmask (the sampler's input) and take its faults."""
        if self.pending_mask is None:
            return
        self.sampling_info.vocab_mask, faults = self.pending_mask.result()
        self.faults += faults
        self.pending_mask = None

    @classmethod
    def prepare(
        cls,
        extend_reqs: list[Req],
        decodes: RunningBatch | None,
        cache_manager: CacheManager,
        token_to_kv_pool: KVPool,
        vocab_size: int,
        eos_token_ids: Collection[int],
        mask_filler: MaskFiller,
    ) -> ScheduleBatch:
        """Allocate rows and KV slots and lay the batch out: `extend_reqs`, then a decode
        step of every request of `decodes` (the running batch, whose lengths advance).

        A prefill continues from what the request's row already maps: its radix hit for a
        new request, its earlier chunks for a chunked one. A decode's input is a future —
        the token the previous batch is sampling for that row — resolved on the forward side.
        """
        if not extend_reqs:
            assert decodes, "a batch needs requests"
            return cls._decode(decodes, cache_manager, token_to_kv_pool, eos_token_ids, mask_filler)
        input_ids: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        rows: list[int] = []
        for req in extend_reqs:
            if req.kv.req_pool_idx is None:
                cache_manager.alloc_row(req)
            start = req.kv.allocated_len
            input_ids += req.all_token_ids()[start : start + req.prefill.extend_input_len]
            prefix_lens.append(start)
            extend_lens.append(req.prefill.extend_input_len)
            rows.append(req_row(req))
        sampling_rows = SamplingRows.from_params(
            [r.sampling_params for r in extend_reqs], vocab_size
        )
        host_ids = _ints(input_ids)
        host_rows, host_prefix, host_extend = _ints(rows), _ints(prefix_lens), _ints(extend_lens)
        reqs, batch_extend_lens = extend_reqs, extend_lens
        mode = ForwardMode.EXTEND
        if decodes:
            mode = ForwardMode.MIXED
            reqs = extend_reqs + decodes.reqs
            batch_extend_lens = extend_lens + decodes.ones_list
            host_ids = torch.cat([host_ids, decodes.futures])
            host_rows = torch.cat([host_rows, decodes.req_pool_indices])
            host_prefix = torch.cat([host_prefix, decodes.seq_lens])
            host_extend = torch.cat([host_extend, decodes.ones])
            sampling_rows = sampling_rows.cat(decodes.sampling_rows)
        out_cache_loc = cache_manager.alloc_slots(sum(batch_extend_lens))
        forward_batch = ForwardBatch.from_host(
            mode,
            host_ids,
            host_rows,
            host_prefix,
            host_extend,
            out_cache_loc,
            cache_manager.req_to_token_pool,
            token_to_kv_pool,
        )
        cache_manager.assign_slots(reqs, forward_batch)
        if decodes:
            decodes.advance()
        device = token_to_kv_pool.device
        forward_batch.prompt_logprobs = prompt_logprobs_input(
            extend_reqs, prefix_lens, extend_lens, len(reqs), device
        )
        sampling_info = SamplingBatchInfo.from_rows(sampling_rows, vocab_size, device)
        if bool(sampling_rows.needs_req_state.any()):
            sampling_info.add_req_state(reqs, sampling_rows, eos_token_ids)
        chunked = frozenset(id(r) for r in extend_reqs if r.prefill.is_chunked)
        return cls(
            reqs,
            batch_extend_lens,
            len(extend_reqs),
            chunked,
            forward_batch,
            sampling_info,
            pending_mask=start_vocab_mask(reqs, chunked, vocab_size, device, mask_filler),
        )

    @classmethod
    def _decode(
        cls,
        decodes: RunningBatch,
        cache_manager: CacheManager,
        token_to_kv_pool: KVPool,
        eos_token_ids: Collection[int],
        mask_filler: MaskFiller,
    ) -> ScheduleBatch:
        """A decode step from the running batch's arrays: no pass over the requests but the
        one that counts their new KV slot, and the sampling state of the last step reused
        unless some request's sampling reads its tokens."""
        reqs = decodes.reqs
        pending_mask = None
        forward_batch = ForwardBatch.from_host(
            ForwardMode.DECODE,
            decodes.futures,
            decodes.req_pool_indices,
            decodes.seq_lens,
            decodes.ones,
            cache_manager.alloc_slots(len(reqs)),
            cache_manager.req_to_token_pool,
            token_to_kv_pool,
        )
        cache_manager.assign_slots(reqs, forward_batch)
        decodes.advance()
        if decodes.num_req_state:
            device = token_to_kv_pool.device
            rows = decodes.sampling_rows
            sampling_info = SamplingBatchInfo.from_rows(rows, decodes.vocab_size, device)
            sampling_info.add_req_state(reqs, rows, eos_token_ids)
            pending_mask = start_vocab_mask(
                reqs, frozenset(), decodes.vocab_size, device, mask_filler
            )
        else:
            sampling_info = decodes.sampling_info()
        return cls(
            reqs,
            decodes.ones_list,
            0,
            frozenset(),
            forward_batch,
            sampling_info,
            pending_mask=pending_mask,
        )


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def prompt_logprobs_input(
    extend_reqs: list[Req],
    prefix_lens: list[int],
    extend_lens: list[int],
    batch_size: int,
    device: torch.device,
) -> PromptLogprobsInput | None:
    """The token rows whose logits give pending prompt logprobs, None when there are none.

    The logits at position q give the logprob of prompt token q + 1, so a request starting
    at `logprob_start_len` s needs positions max(s - 1, 0) .. len(prompt) - 2; this batch
    computes its positions prefix_len .. prefix_len + extend_len - 1 of them. A chunk's
    last position predicts the next chunk's first token, so chunks join without a gap; the
    radix match stopped before the first needed position (`Req.max_prefix_len`).
    """
    rows: list[torch.Tensor] = []
    next_ids: list[int] = []
    rows_per_req = [0] * batch_size
    top_k = 0
    offset = 0
    for i, (req, prefix_len, extend_len) in enumerate(zip(extend_reqs, prefix_lens, extend_lens)):
        if req.prompt_logprobs_pending:
            params = req.sampling_params
            first = max(params.logprob_start_len - 1, 0, prefix_len)
            last = min(prefix_len + extend_len, len(req.origin_input_ids) - 1)  # exclusive
            if last > first:
                rows.append(torch.arange(first, last) + (offset - prefix_len))
                next_ids += req.origin_input_ids[first + 1 : last + 1]
                rows_per_req[i] = last - first
                top_k = max(top_k, params.prompt_top_logprobs_num)
        offset += extend_len
    if not rows:
        return None
    return PromptLogprobsInput(
        torch.cat(rows).to(device, non_blocking=True),
        torch.tensor(next_ids, dtype=torch.int64).to(device, non_blocking=True),
        top_k,
        rows_per_req,
    )


def start_vocab_mask(
    reqs: list[Req],
    chunked: frozenset[int],
    vocab_size: int,
    device: torch.device,
    mask_filler: MaskFiller,
) -> PendingMask | None:
    """Start filling the grammar bitmask of a batch (`MaskFiller`): each grammar row by its
    matcher; other rows, and chunked prefills (which sample nothing), stay all-allowed. The
    matchers must already have accepted every token sampled so far: the scheduler resolves
    the in-flight batch first."""
    rows = [
        MaskRow(i, r, grammar)
        for i, r in enumerate(reqs)
        if (grammar := r.grammar.matcher) is not None and id(r) not in chunked
    ]
    if not rows:
        return None
    return mask_filler.start(rows, len(reqs), vocab_size, device)
