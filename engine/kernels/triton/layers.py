"""One Triton kernel for each of the decoder layer's elementwise steps on CUDA: residual add
with RMSNorm, rotary over q and k together, SiLU-and-mul. In eager PyTorch these are 5 to
10 launches each; fused, a layer is about 12 launches in all (norms, rotary, activation,
four matmuls, the KV write and the two attention stages).

Each kernel computes in float32 and rounds to the activations' dtype exactly where the
torch path (and transformers) rounds, so that the two agree to reduction order.
Importing this module imports Triton; the layers import it only for CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    X: tl.tensor,
    Residual: tl.tensor,
    W: tl.tensor,
    Out: tl.tensor,
    stride_x: tl.tensor,
    stride_r: tl.tensor,
    stride_o: tl.tensor,
    n_cols: tl.tensor,
    eps: tl.tensor,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = Out.dtype.element_ty
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(dtype)
        tl.store(Residual + row * stride_r + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (w * normed).to(dtype), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`weight * rmsnorm(x)` over the last dim of a 2-D `x`; with `residual`, of
    `x + residual`, which is also written into `residual` (the next residual stream)."""
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    res = x if residual is None else residual
    _rmsnorm_kernel[(n_rows,)](
        x,
        res,
        weight,
        out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(n_cols),
    )
    return out


@triton.jit
def _rotary_kernel(
    QK: tl.tensor,
    CosSin: tl.tensor,
    stride_t: tl.tensor,
    stride_h: tl.tensor,
    stride_cs_t: tl.tensor,
    stride_cs_k: tl.tensor,
    num_heads: tl.tensor,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    cs = CosSin + token * stride_cs_t + dims
    cos = tl.load(cs, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    # The sine's second half: the first is stored negated, for the torch path.
    sin = tl.load(cs + stride_cs_k + HALF, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    dtype = QK.dtype.element_ty
    first = QK + token * stride_t + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded as transformers rounds it.
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


def rotary_(qk: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate `qk` `[T, heads, D]` (q's heads then k's, last dim contiguous) in place by
    `cos_sin` `[T, 2, 1, D]` (cos, then sin with its first half negated), as
    RotaryEmbedding.cos_sin lays it out."""
    num_tokens, num_heads, head_dim = qk.shape
    _rotary_kernel[(num_tokens,)](
        qk,
        cos_sin,
        qk.stride(0),
        qk.stride(1),
        cos_sin.stride(0),
        cos_sin.stride(1),
        num_heads,
        HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim // 2),
    )


@triton.jit
def _silu_and_mul_kernel(
    X: tl.tensor,
    Out: tl.tensor,
    stride_x: tl.tensor,
    stride_o: tl.tensor,
    d: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = Out.dtype.element_ty
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * up).to(dtype), mask=mask)


SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for a 2-D `x` = `[gate | up]`."""
    n_rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((n_rows, d), dtype=x.dtype, device=x.device)
    _silu_and_mul_kernel[(n_rows, triton.cdiv(d, SILU_BLOCK))](
        x, out, x.stride(0), out.stride(0), d, BLOCK=SILU_BLOCK
    )
    return out
