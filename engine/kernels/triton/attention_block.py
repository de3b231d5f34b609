"""The block step both Triton attention kernels share: a block of keys loaded through their
pool slots, and a block of scores folded into a running (online) softmax with its values;
and where a query's sliding window starts.
`tl.dot` asks for `input_precision="ieee"` (see the package's docstring)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_keys(
    K_Buffer: tl.tensor,
    slots: tl.tensor,
    cur_kv_head: tl.tensor,
    stride_buf_kbs: tl.tensor,
    stride_buf_kh: tl.tensor,
    offs_d: tl.tensor,
    mask_n: tl.tensor,
    mask_d: tl.tensor,
) -> tl.tensor:
    """The keys at `slots` for one KV head, transposed `[BLOCK_DMODEL, BLOCK_N]` for q @ k."""
    k_ptrs = (
        K_Buffer + slots[None, :] * stride_buf_kbs + cur_kv_head * stride_buf_kh + offs_d[:, None]
    )
    return tl.load(k_ptrs, mask=mask_n[None, :] & mask_d[:, None], other=0.0)


@triton.jit
def fold_block(
    qk: tl.tensor,
    m_i: tl.tensor,
    l_i: tl.tensor,
    acc: tl.tensor,
    V_Buffer: tl.tensor,
    slots: tl.tensor,
    cur_kv_head: tl.tensor,
    stride_buf_vbs: tl.tensor,
    stride_buf_vh: tl.tensor,
    offs_d: tl.tensor,
    mask_n: tl.tensor,
    mask_d: tl.tensor,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Scores `qk` (masked to -inf) of a block into the running max `m_i`, sum `l_i` and
    weighted values `acc`, rescaled to the new max: the new three. A row that has seen no
    key yet (under a sliding window a block may hold none of a row's keys) stays at zero."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # not -inf - -inf
    re_scale = tl.exp(m_i - m_safe)
    p = tl.exp(qk - m_safe[:, None])
    l_new = l_i * re_scale + tl.sum(p, 1)
    v_ptrs = (
        V_Buffer + slots[:, None] * stride_buf_vbs + cur_kv_head * stride_buf_vh + offs_d[None, :]
    )
    v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    acc = acc * re_scale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_new, acc


@triton.jit
def window_start(position: tl.tensor, window: tl.tensor) -> tl.tensor:
    """The first key position a query at `position` sees under a sliding `window`, the keys
    at (position - window, position]; 0 when `window` is 0 (full attention)."""
    return tl.where(window > 0, tl.maximum(position - window + 1, 0), 0)
