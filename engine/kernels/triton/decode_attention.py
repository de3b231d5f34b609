"""Split-KV (flash-decoding) attention for one new token per request.

A decode batch has too few queries to fill a GPU if each request is one program, so each
request's keys are cut into `num_kv_splits[i]` contiguous splits. Keys are read through the
request's row of `req_to_token` itself, and the new token's from `out_cache_loc`: no
per-step index list whose length depends on the batch, so the launch has static
arguments and can be captured in a CUDA graph. Stage 1 runs one program
per (request, KV head, split): it loads every query head of the GQA group that shares the
KV head, so each K/V tile is read once per group, and writes the split's normalised
partial output with its log-sum-exp. Stage 2 merges the splits of each (request, head).

A layer with a sliding window reads only each request's last `window` keys: the splits cut
those, as many as the host's count for the whole context allows with none empty
(`_attended_splits`), so one split count serves every layer of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.attention_block import fold_block, load_keys, window_start


@triton.jit
def _attended_splits(
    seq_len: tl.tensor, window: tl.tensor, kv_splits: tl.tensor
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """The keys a request's query attends, from the first in its sliding `window` (0:
    none) to its last, cut into at most `kv_splits` (the host's count for the whole context)
    splits of equal length, none empty: (first key, split length, split count). Without a
    window the host's count as it is: it already leaves no split empty."""
    first = window_start(seq_len - 1, window)
    split_len = tl.cdiv(seq_len - first, kv_splits)
    return first, split_len, tl.cdiv(seq_len - first, split_len)


@triton.jit
def _fwd_grouped_kernel_stage1(
    Q: tl.tensor,
    K_Buffer: tl.tensor,
    V_Buffer: tl.tensor,
    req_to_token: tl.tensor,
    req_pool_indices: tl.tensor,
    seq_lens: tl.tensor,
    out_cache_loc: tl.tensor,
    num_kv_splits: tl.tensor,
    sm_scale: tl.tensor,
    window: tl.tensor,
    Att_Out: tl.tensor,
    Att_Lse: tl.tensor,
    stride_req_to_token: tl.tensor,
    stride_qbs: tl.tensor,
    stride_qh: tl.tensor,
    stride_buf_kbs: tl.tensor,
    stride_buf_kh: tl.tensor,
    stride_buf_vbs: tl.tensor,
    stride_buf_vh: tl.tensor,
    stride_mid_ob: tl.tensor,
    stride_mid_oh: tl.tensor,
    stride_mid_os: tl.tensor,
    stride_lse_b: tl.tensor,
    stride_lse_h: tl.tensor,
    kv_group_num: tl.constexpr,
    Lk: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    cur_batch = tl.program_id(0)
    cur_kv_head = tl.program_id(1)
    split_kv_id = tl.program_id(2)

    seq_len = tl.load(seq_lens + cur_batch).to(tl.int32)
    first_key, split_len, kv_splits = _attended_splits(
        seq_len, window, tl.load(num_kv_splits + cur_batch)
    )
    if split_kv_id >= kv_splits:
        return
    table_row = req_to_token + tl.load(req_pool_indices + cur_batch) * stride_req_to_token
    new_slot = tl.load(out_cache_loc + cur_batch)
    split_start = first_key + split_len * split_kv_id
    split_end = tl.minimum(split_start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < kv_group_num
    cur_head = cur_kv_head * kv_group_num + offs_h
    offs_d = tl.arange(0, BLOCK_DMODEL)
    mask_d = offs_d < Lk
    offs_n = tl.arange(0, BLOCK_N)

    q_ptrs = Q + cur_batch * stride_qbs + cur_head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(
        K_Buffer.dtype.element_ty
    )

    # Padded head rows see q = 0, hence finite scores; they are never stored.
    e_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    e_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DMODEL], dtype=tl.float32)
    for start_n in range(split_start, split_end, BLOCK_N):
        kv_pos = start_n + offs_n
        mask_n = kv_pos < split_end
        # The new token's table entry may not be written yet: its slot is out_cache_loc's.
        slots = tl.load(table_row + kv_pos, mask=mask_n & (kv_pos < seq_len - 1), other=0)
        slots = tl.where(kv_pos == seq_len - 1, new_slot, slots.to(tl.int64))

        k = load_keys(
            K_Buffer, slots, cur_kv_head, stride_buf_kbs, stride_buf_kh, offs_d, mask_n, mask_d
        )
        qk = tl.dot(q, k, input_precision="ieee") * sm_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        e_max, e_sum, acc = fold_block(
            qk,
            e_max,
            e_sum,
            acc,
            V_Buffer,
            slots,
            cur_kv_head,
            stride_buf_vbs,
            stride_buf_vh,
            offs_d,
            mask_n,
            mask_d,
        )

    mid_o = (
        Att_Out
        + cur_batch * stride_mid_ob
        + cur_head[:, None] * stride_mid_oh
        + split_kv_id * stride_mid_os
    )
    tl.store(mid_o + offs_d[None, :], acc / e_sum[:, None], mask=mask_h[:, None] & mask_d[None, :])
    mid_lse = Att_Lse + cur_batch * stride_lse_b + cur_head * stride_lse_h + split_kv_id
    tl.store(mid_lse, e_max + tl.log(e_sum), mask=mask_h)


@triton.jit
def _fwd_kernel_stage2(
    Att_Out: tl.tensor,
    Att_Lse: tl.tensor,
    Out: tl.tensor,
    seq_lens: tl.tensor,
    num_kv_splits: tl.tensor,
    window: tl.tensor,
    stride_mid_ob: tl.tensor,
    stride_mid_oh: tl.tensor,
    stride_mid_os: tl.tensor,
    stride_lse_b: tl.tensor,
    stride_lse_h: tl.tensor,
    stride_obs: tl.tensor,
    stride_oh: tl.tensor,
    Lv: tl.constexpr,
    BLOCK_DV: tl.constexpr,
) -> None:
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    seq_len = tl.load(seq_lens + cur_batch).to(tl.int32)
    kv_splits = _attended_splits(seq_len, window, tl.load(num_kv_splits + cur_batch))[2]

    offs_d = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < Lv
    mid_o = Att_Out + cur_batch * stride_mid_ob + cur_head * stride_mid_oh
    mid_lse = Att_Lse + cur_batch * stride_lse_b + cur_head * stride_lse_h

    e_max = float("-inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for split_kv_id in range(0, kv_splits):
        tv = tl.load(mid_o + split_kv_id * stride_mid_os + offs_d, mask=mask_d, other=0.0)
        tlse = tl.load(mid_lse + split_kv_id)
        n_e_max = tl.maximum(tlse, e_max)
        old_scale = tl.exp(e_max - n_e_max)
        exp_lse = tl.exp(tlse - n_e_max)
        acc = acc * old_scale + exp_lse * tv
        e_sum = e_sum * old_scale + exp_lse
        e_max = n_e_max

    o_ptrs = Out + cur_batch * stride_obs + cur_head * stride_oh + offs_d
    tl.store(o_ptrs, (acc / e_sum).to(Out.dtype.element_ty), mask=mask_d)


def decode_attention_fwd(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    num_kv_splits: torch.Tensor,
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    sm_scale: float,
    window: int = 0,
) -> None:
    """Write into `o` ([B, H, D]) the attention of the one query per request in `q` ([B, H, D]).

    Request i's `seq_lens[i]` keys are at the slots `req_to_token[req_pool_indices[i]]`
    maps, the last at `out_cache_loc[i]`, cut into `num_kv_splits[i]` splits; with a sliding
    `window` > 0 only the last `window` of them, the table entries before never read.
    `attn_logits` ([B, H, max_kv_splits, D], fp32) and `attn_lse` ([B, H, max_kv_splits],
    fp32) hold the per-split partial results; the grid spans
    `max_kv_splits`, and programs past a request's own split count exit at once.
    """
    assert q.stride(-1) == 1 and o.stride(-1) == 1, "head_dim must be the contiguous axis"
    assert req_to_token.stride(-1) == 1, "a table row must be contiguous"
    assert attn_logits.stride(-1) == 1 and attn_lse.stride(-1) == 1, (
        "partial buffers must be contiguous per row"
    )
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    kv_group_num = num_heads // num_kv_heads
    max_kv_splits = attn_logits.shape[2]
    block_dmodel = triton.next_power_of_2(head_dim)
    _fwd_grouped_kernel_stage1[(batch_size, num_kv_heads, max_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        out_cache_loc,
        num_kv_splits,
        sm_scale,
        window,
        attn_logits,
        attn_lse,
        req_to_token.stride(0),
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        attn_logits.stride(0),
        attn_logits.stride(1),
        attn_logits.stride(2),
        attn_lse.stride(0),
        attn_lse.stride(1),
        kv_group_num=kv_group_num,
        Lk=head_dim,
        BLOCK_DMODEL=block_dmodel,
        # tl.dot needs at least 16 rows; one program covers the whole GQA group.
        BLOCK_H=max(16, triton.next_power_of_2(kv_group_num)),
        BLOCK_N=64 if k_buffer.element_size() <= 2 else 32,
        num_warps=4,
    )
    _merge_splits(attn_logits, attn_lse, o, seq_lens, num_kv_splits, window)


def _merge_splits(
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    o: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor,
    window: int,
) -> None:
    """Stage 2: each (request, head)'s split results summed into `o` by their log-sum-exp."""
    batch_size, num_heads, head_dim = o.shape
    _fwd_kernel_stage2[(batch_size, num_heads)](
        attn_logits,
        attn_lse,
        o,
        seq_lens,
        num_kv_splits,
        window,
        attn_logits.stride(0),
        attn_logits.stride(1),
        attn_logits.stride(2),
        attn_lse.stride(0),
        attn_lse.stride(1),
        o.stride(0),
        o.stride(1),
        Lv=head_dim,
        BLOCK_DV=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
