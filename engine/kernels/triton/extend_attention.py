"""Extend (prefill) attention: every new token attends to its request's cached prefix and,
causally, to the new tokens before it.

Each request's keys are named by one run of `kv_indices` (the prefix slots from
`req_to_token`, then the new tokens' slots from `out_cache_loc`), so a single online-softmax
loop covers prefix and extension; the causal mask only bites in the last blocks, and blocks
past a query tile's last position are never visited. Under a sliding window the loop starts
at the first key the tile's first query sees: keys before every row's window are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.attention_block import fold_block, load_keys, window_start


@triton.jit
def _fwd_kernel(
    Q: tl.tensor,
    Out: tl.tensor,
    K_Buffer: tl.tensor,
    V_Buffer: tl.tensor,
    qo_indptr: tl.tensor,
    kv_indptr: tl.tensor,
    kv_indices: tl.tensor,
    sm_scale: tl.tensor,
    window: tl.tensor,
    stride_qbs: tl.tensor,
    stride_qh: tl.tensor,
    stride_obs: tl.tensor,
    stride_oh: tl.tensor,
    stride_buf_kbs: tl.tensor,
    stride_buf_kh: tl.tensor,
    stride_buf_vbs: tl.tensor,
    stride_buf_vh: tl.tensor,
    kv_group_num: tl.constexpr,
    Lk: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    cur_seq = tl.program_id(0)
    cur_head = tl.program_id(1)
    cur_block_m = tl.program_id(2)
    cur_kv_head = cur_head // kv_group_num

    q_start = tl.load(qo_indptr + cur_seq)
    extend_len = tl.load(qo_indptr + cur_seq + 1) - q_start
    if cur_block_m * BLOCK_M >= extend_len:
        return
    kv_start = tl.load(kv_indptr + cur_seq)
    seq_len = tl.load(kv_indptr + cur_seq + 1) - kv_start
    prefix_len = seq_len - extend_len

    offs_m = cur_block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_DMODEL)
    mask_m = offs_m < extend_len
    mask_d = offs_d < Lk

    q_ptrs = Q + (q_start + offs_m)[:, None] * stride_qbs + cur_head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(
        K_Buffer.dtype.element_ty
    )
    q_pos = prefix_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DMODEL], dtype=tl.float32)

    # Keys beyond this tile's last query position are masked for every row, and so are keys
    # before its first query's sliding window: skip them.
    kv_end = tl.minimum(seq_len, prefix_len + (cur_block_m + 1) * BLOCK_M)
    kv_first = window_start(prefix_len + cur_block_m * BLOCK_M, window)
    for start_n in range(kv_first, kv_end, BLOCK_N):
        kv_pos = start_n + offs_n
        mask_n = kv_pos < kv_end
        slots = tl.load(kv_indices + kv_start + kv_pos, mask=mask_n, other=0).to(tl.int64)

        k = load_keys(
            K_Buffer, slots, cur_kv_head, stride_buf_kbs, stride_buf_kh, offs_d, mask_n, mask_d
        )
        qk = tl.dot(q, k, input_precision="ieee") * sm_scale
        visible = mask_n[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        visible = visible & (kv_pos[None, :] >= window_start(q_pos, window)[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_i, l_i, acc = fold_block(
            qk,
            m_i,
            l_i,
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

    # Rows past the request's queries may have seen no key under a window: not stored, but
    # kept finite. Every real row saw itself, so its sum is at least 1.
    l_i = tl.where(l_i > 0, l_i, 1.0)
    o_ptrs = Out + (q_start + offs_m)[:, None] * stride_obs + cur_head * stride_oh + offs_d[None, :]
    tl.store(
        o_ptrs,
        (acc / l_i[:, None]).to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention_fwd(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    window: int = 0,
) -> None:
    """Write into `o` ([T, H, D]) the attention of `q` ([T, H, D]) over the KV pool.

    Request i owns queries `qo_indptr[i]:qo_indptr[i+1]` and keys
    `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`; its last `extend_len` keys are its own new
    tokens, aligned with its queries. A sliding `window` > 0: the query at position p sees
    the keys at (p - window, p], and no key before its tile's first window is read.
    `max_extend_len` sizes the grid from host data, so the launch never reads a device
    value.
    """
    assert q.stride(-1) == 1 and o.stride(-1) == 1, "head_dim must be the contiguous axis"
    batch_size = qo_indptr.shape[0] - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_group_num = num_heads // k_buffer.shape[1]
    # fp32 tiles are twice as wide in shared memory: halve the key block to fit.
    block_m, block_n = (64, 64) if k_buffer.element_size() <= 2 else (64, 32)
    grid = (batch_size, num_heads, triton.cdiv(max_extend_len, block_m))
    _fwd_kernel[grid](
        q,
        o,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        sm_scale,
        window,
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        kv_group_num=kv_group_num,
        Lk=head_dim,
        BLOCK_DMODEL=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4,
    )
