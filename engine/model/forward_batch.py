"""What one forward pass needs to know about the batch, already laid out as tensors."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.mem.swa_kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = enum.auto()
    """Prefill: each request adds `extend_lens[i]` tokens after `prefix_lens[i]` cached ones."""
    DECODE = enum.auto()
    """Each request adds exactly one token."""
    MIXED = enum.auto()
    """Extend requests first, then decode requests riding along (extend_len 1)."""
    TARGET_VERIFY = enum.auto()
    """Speculative verification: each request adds its draft tree (`tree_ancestors`), every
    node at `prefix_len + depth`, attending to the prefix and its own path; every node
    gets logits."""

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY


@dataclass
class PromptLogprobsInput:
    """Which token rows of an extend batch also get the logprob of the prompt token after
    them. Only the requests asking for prompt logprobs have rows here, and only from the
    first position they need: every other row gets no vocabulary projection."""

    token_rows: torch.Tensor  # [N] int64: rows of the batch's token-major hidden states
    next_token_ids: torch.Tensor  # [N] int64: the prompt token each row predicts
    top_k: int
    """How many likeliest alternatives per row: the largest any of those requests asks."""
    rows_per_req: list[int]
    """Per request of the batch, how many of the N rows are its (in order; decodes have 0)."""


@dataclass
class ForwardBatch:
    """One batch, token-major. Every mode is described as "extend": request i has
    `prefix_lens[i]` tokens already in the KV pool (read through `req_to_token`) and
    `extend_lens[i]` new tokens whose K/V are written at `out_cache_loc`; a decode request
    is an extend of length 1. `seq_lens = prefix_lens + extend_lens`.

    Tensors live on the model's device; the `*_cpu` lists mirror the small per-request
    vectors so that backends can plan shapes without a device sync.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [batch] int64
    seq_lens: torch.Tensor  # [batch] int64
    prefix_lens: torch.Tensor  # [batch] int64
    extend_lens: torch.Tensor  # [batch] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: KVPool
    prompt_logprobs: PromptLogprobsInput | None = None
    """Set when some extend request asks for prompt logprobs (the scheduler sets it)."""
    lora_slots: torch.Tensor | None = None
    """[batch] int64 on the device: each request's LoRA adapter slot id (0: none); None
    when no request of the batch has an adapter (the scheduler sets it)."""
    on_layers_start: Callable[[], None] | None = None
    """Called by the model as its forward enters the layers (the CPU overlap loop's forward
    thread sets it: engine/sched/forward_thread.py)."""
    on_layer_end: Callable[[], None] | None = None
    """Called by the model after each layer of a prefill: a long forward shows progress to
    a watchdog that would otherwise see only a turn that has not ended."""
    tree_ancestors: torch.Tensor | None = None
    """TARGET_VERIFY: `[num_tokens, max_depth + 1]` int64, row t the batch token of node t's
    ancestor at each depth (node t itself at its own), -1 past its depth."""

    @classmethod
    def from_host(
        cls,
        forward_mode: ForwardMode,
        input_ids: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: KVPool,
        tree_depths: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """Lay out per-request host vectors (int64) on the pool's device, positions
        included, in a fixed number of tensor ops whatever the batch size; the vectors stay
        on the host as the `*_cpu` mirrors. `tree_depths` (TARGET_VERIFY): each token's
        depth in its request's draft tree, which places it."""
        seq_lens = prefix_lens + extend_lens
        if forward_mode.is_decode():
            positions = prefix_lens
        elif tree_depths is not None:
            positions = torch.repeat_interleave(prefix_lens, extend_lens) + tree_depths
        else:
            # Token t of request i sits at prefix_lens[i] + (t - first token of i).
            starts = torch.cumsum(extend_lens, 0) - extend_lens
            num_tokens = len(input_ids)
            offsets = torch.repeat_interleave(
                prefix_lens - starts, extend_lens, output_size=num_tokens
            )
            positions = torch.arange(num_tokens, dtype=torch.int64) + offsets
        host = [input_ids, positions, req_pool_indices, seq_lens, prefix_lens, extend_lens]
        device_ids, device_positions, device_rows, device_seq_lens, device_prefix, device_extend = (
            _to_device(host, token_to_kv_pool.device)
        )
        return cls(
            forward_mode=forward_mode,
            input_ids=device_ids,
            positions=device_positions,
            req_pool_indices=device_rows,
            seq_lens=device_seq_lens,
            prefix_lens=device_prefix,
            extend_lens=device_extend,
            out_cache_loc=out_cache_loc,
            seq_lens_cpu=seq_lens.tolist(),
            prefix_lens_cpu=prefix_lens.tolist(),
            extend_lens_cpu=extend_lens.tolist(),
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
        )

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)


def _to_device(vectors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`vectors` on `device`. On CUDA they are packed into one pinned buffer and sent in one
    non-blocking copy, so the scheduler never waits for the device here; torch's caching
    host allocator keeps that buffer from reuse until the copy has run."""
    if device.type != "cuda":
        return [v.to(device) for v in vectors]
    sizes = [len(v) for v in vectors]
    staged = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    torch.cat(vectors, out=staged)
    return list(staged.to(device, non_blocking=True).split(sizes))
