"""The LoRA term on CUDA as a segment kernel: each request's tokens (a segment) are
multiplied by its own adapter's A, then B, read from the slot buffers in place. The torch
path (engine/lora/layers.py) multiplies every token by every slot and zeroes the other
slots' columns; this one does only the work of each token's own slot.

One kernel serves both halves, a `[tokens, n_in] @ slot-weights^T` per segment:
- shrink: `xa = scaling * x @ A[slot]^T`, A's slot rows `[slot_width, n_in]`;
- expand: `y += xa @ B[:, slot]^T`, B's slot columns `[n_out, slot_width]`.
Its grid is (segments, output blocks, row blocks of the longest segment); every size it
reads at run time comes from device tensors, so a decode batch (one token per segment, one
row block) replays from a CUDA graph with its segment buffers static.
Importing this module imports Triton; the LoRA layers import it only for CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16
"""Rows of a segment per program: tl.dot's smallest tile; a decode segment is one row."""


@triton.jit
def _segment_matmul_kernel(
    X: tl.tensor,
    W: tl.tensor,
    Out: tl.tensor,
    SegIndptr: tl.tensor,
    SegSlots: tl.tensor,
    Scalings: tl.tensor,
    n_out: tl.tensor,
    n_in: tl.tensor,
    stride_xm: tl.tensor,
    stride_xk: tl.tensor,
    stride_om: tl.tensor,
    stride_on: tl.tensor,
    stride_ws: tl.tensor,
    stride_wn: tl.tensor,
    stride_wk: tl.tensor,
    ADD: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    seg = tl.program_id(0)
    slot = tl.load(SegSlots + seg)
    if slot > 0:  # slot id 0: no adapter, nothing to add
        start = tl.load(SegIndptr + seg)
        end = tl.load(SegIndptr + seg + 1)
        rows = start + tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < end
        col_mask = cols < n_out
        w_slot = W + (slot - 1) * stride_ws
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < n_in
            x = tl.load(
                X + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            w = tl.load(
                w_slot + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                mask=col_mask[None, :] & k_mask[:, None],
                other=0.0,
            )
            acc += tl.dot(x, w, input_precision="ieee")
        if SCALE:
            acc *= tl.load(Scalings + slot).to(tl.float32)
        out_ptrs = Out + rows[:, None] * stride_om + cols[None, :] * stride_on
        out_mask = row_mask[:, None] & col_mask[None, :]
        dtype = Out.dtype.element_ty
        if ADD:
            acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(dtype), mask=out_mask)


def _block(size: int) -> int:
    """A tile edge for a dimension of `size`: a power of two from 16 (tl.dot's least) to 64."""
    return min(64, max(16, triton.next_power_of_2(size)))


def _segment_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    slot_stride: int,
    out: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scalings: torch.Tensor,
    max_seg_len: int,
    add: bool,
) -> None:
    """`out[segment rows] (+)= (scaling *) x[rows] @ weight[slot]^T` for each segment, where
    slot s's `[n_out, n_in]` matrix starts `(s - 1) * slot_stride` elements into `weight`
    with strides `weight.stride()`."""
    n_out, n_in = out.shape[1], x.shape[1]
    grid = (len(seg_slots), triton.cdiv(n_out, _block(n_out)), triton.cdiv(max_seg_len, BLOCK_M))
    _segment_matmul_kernel[grid](
        x,
        weight,
        out,
        seg_indptr,
        seg_slots,
        scalings,
        n_out,
        n_in,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        slot_stride,
        weight.stride(0),
        weight.stride(1),
        ADD=add,
        SCALE=not add,
        BLOCK_M=BLOCK_M,
        BLOCK_N=_block(n_out),
        BLOCK_K=_block(n_in),
    )


def segment_lora(
    x: torch.Tensor,
    y: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_width: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scalings: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """`y` plus each segment's LoRA term, in place: `lora_a` `[slots * slot_width, n_in]`
    and `lora_b` `[n_out, slots * slot_width]` are the stacked slot buffers, `seg_slots`
    each segment's slot id (0: none) and `scalings[slot id]` its adapter's scaling."""
    xa = torch.empty(len(x), slot_width, dtype=x.dtype, device=x.device)
    args = (seg_indptr, seg_slots, scalings, max_seg_len)
    _segment_matmul(x, lora_a, slot_width * lora_a.stride(0), xa, *args, add=False)
    # B's slot is a block of its columns: slot s starts s * slot_width columns in.
    _segment_matmul(xa, lora_b, slot_width * lora_b.stride(1), y, *args, add=True)
    return y
