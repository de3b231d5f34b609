"""GGUF block weights multiplied on CUDA as stored: `y = x @ dequant(W)^T + b`, W the uint8
rows the CPU kernels read (engine/model/layers/quantization.py, the layouts in
engine/kernels/cpu/csrc/quant_formats.h), every format decoded by one function,
`_dequant`, in registers for each tile of W: no float copy of the weight is ever made.
Formats are GGML's type ids and a kernel argument known at compile time, so each format
gets its own compiled kernel from the one source.

The matmul tiles x by 16 rows (tl.dot's least) for a decode batch, else by 64; the
embedding's lookup (`gguf_embedding`) decodes just the rows of the ids asked for.
Importing this module imports Triton; the layers import it only for CUDA tensors.
"""

from __future__ import annotations

import gguf
import torch
import triton
import triton.language as tl

Q4_0: tl.constexpr = tl.constexpr(int(gguf.GGMLQuantizationType.Q4_0))
Q4_1: tl.constexpr = tl.constexpr(int(gguf.GGMLQuantizationType.Q4_1))
Q5_0: tl.constexpr = tl.constexpr(int(gguf.GGMLQuantizationType.Q5_0))
Q5_1: tl.constexpr = tl.constexpr(int(gguf.GGMLQuantizationType.Q5_1))
Q8_0: tl.constexpr = tl.constexpr(int(gguf.GGMLQuantizationType.Q8_0))
Q4_K: tl.constexpr = tl.constexpr(int(gguf.GGMLQuantizationType.Q4_K))
Q5_K: tl.constexpr = tl.constexpr(int(gguf.GGMLQuantizationType.Q5_K))
Q6_K: tl.constexpr = tl.constexpr(int(gguf.GGMLQuantizationType.Q6_K))

BLOCK_N = 64
"""Rows of W per program."""


@triton.jit
def _byte(ptr: tl.tensor, mask: tl.tensor) -> tl.tensor:
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(ptr: tl.tensor, mask: tl.tensor) -> tl.tensor:
    """The little-endian float16 at `ptr`, as float32 (GGUF's d, m and dmin)."""
    bits = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    bits |= tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16) << 8
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant(
    row: tl.tensor,
    ks: tl.tensor,
    mask: tl.tensor,
    FORMAT: tl.constexpr,
    QK: tl.constexpr,
    BYTES: tl.constexpr,
) -> tl.tensor:
    """Weights `ks` of the rows starting at byte pointers `row` (the two broadcast to the
    tile's shape), as float32, each rounded as gguf-py's dequantizer rounds it."""
    block = row + (ks // QK) * BYTES
    j = ks % QK
    if FORMAT == Q8_0:
        q = tl.load(block + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = _half(block, mask) * q.to(tl.float32)
    elif FORMAT == Q6_K:  # ql[128], qh[64], int8 scales[16], half d; halves of 4 runs of 32
        half = j // 128
        run = j % 128 // 32
        lane = j % 32
        low = _byte(block + half * 64 + run % 2 * 32 + lane, mask) >> (run // 2 * 4) & 0x0F
        high = _byte(block + 128 + half * 32 + lane, mask) >> (run * 2) & 0x03
        scale = tl.load(block + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        d = _half(block + 208, mask) * scale.to(tl.float32)
        w = d * ((low | high << 4) - 32).to(tl.float32)
    elif FORMAT == Q4_K or FORMAT == Q5_K:  # half d, half dmin, 12 bytes of factors, ...
        sub = j // 32
        lane = j % 32
        nibbles_at = 48 if FORMAT == Q5_K else 16
        q = _byte(block + nibbles_at + sub // 2 * 32 + lane, mask) >> (sub % 2 * 4) & 0x0F
        if FORMAT == Q5_K:
            q |= (_byte(block + 16 + lane, mask) >> sub & 1) << 4
        # 6-bit scale and min of sub-block s: s < 4 in the low bits of bytes s and s + 4;
        # s >= 4 in the nibbles of byte s + 4, over the top bits of bytes s - 4 and s.
        first = _byte(block + 4 + sub % 4, mask)
        second = _byte(block + 8 + sub % 4, mask)
        third = _byte(block + 12 + sub % 4, mask)
        sc = tl.where(sub < 4, first & 63, (third & 0x0F) | (first >> 6) << 4)
        m = tl.where(sub < 4, second & 63, (third >> 4) | (second >> 6) << 4)
        d = _half(block, mask) * sc.to(tl.float32)
        dm = _half(block + 2, mask) * m.to(tl.float32)
        w = d * q.to(tl.float32) - dm
    else:  # Q4_0, Q4_1, Q5_0, Q5_1: half d, [half m], [32 fifth bits], 16 bytes of nibbles
        has_min = FORMAT == Q4_1 or FORMAT == Q5_1
        fifth_at = 4 if has_min else 2
        nibbles_at = fifth_at + (4 if FORMAT == Q5_0 or FORMAT == Q5_1 else 0)
        q = _byte(block + nibbles_at + j % 16, mask) >> (j // 16 * 4) & 0x0F
        if FORMAT == Q5_0 or FORMAT == Q5_1:
            q |= (_byte(block + fifth_at + j // 8, mask) >> (j % 8) & 1) << 4
        d = _half(block, mask)
        if has_min:
            w = d * q.to(tl.float32) + _half(block + 2, mask)
        else:
            zero = 16 if FORMAT == Q5_0 else 8
            w = d * (q - zero).to(tl.float32)
    return w


@triton.jit
def _gguf_matmul_kernel(
    X: tl.tensor,
    W: tl.tensor,
    Bias: tl.tensor,
    Out: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    stride_xm: tl.tensor,
    stride_wn: tl.tensor,
    stride_om: tl.tensor,
    FORMAT: tl.constexpr,
    QK: tl.constexpr,
    BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    w_rows = W + cols[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]: W^T's columns
    x_rows = X + rows[:, None].to(tl.int64) * stride_xm
    dtype = X.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides K: no mask along K
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None], other=0.0)
        w = _dequant(w_rows, ks[:, None], col_mask[None, :], FORMAT, QK, BYTES)
        acc += tl.dot(x, w.to(dtype), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = Out + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _gguf_rows_kernel(
    W: tl.tensor,
    Ids: tl.tensor,
    Out: tl.tensor,
    K: tl.tensor,
    stride_wn: tl.tensor,
    stride_om: tl.tensor,
    FORMAT: tl.constexpr,
    QK: tl.constexpr,
    BYTES: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    i = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row = W + tl.load(Ids + i).to(tl.int64) * stride_wn
    w = _dequant(row, ks, ks < K, FORMAT, QK, BYTES)
    tl.store(Out + i.to(tl.int64) * stride_om + ks, w.to(Out.dtype.element_ty), mask=ks < K)


def _layout(format: int) -> tuple[int, int]:
    """(weights, bytes) of one block of `format`, as gguf-py knows it."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(format)]
    return block, size


def gguf_linear(
    x: torch.Tensor, weight: torch.Tensor, format: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ W^T + bias` in `x`'s dtype for `x` `[..., K]` (float32, float16 or bfloat16)
    over `weight`, `[N, row bytes]` uint8 rows of `format`'s blocks."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    qk, size = _layout(format)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    _gguf_matmul_kernel[grid](
        rows,
        weight,
        out if bias is None else bias,  # not read without a bias
        out,
        m,
        n,
        k,
        rows.stride(0),
        weight.stride(0),
        out.stride(0),
        FORMAT=format,
        QK=qk,
        BYTES=size,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=64 if k % 64 == 0 else 32,
    )
    return out.view(*x.shape[:-1], n)


def gguf_embedding(
    weight: torch.Tensor, ids: torch.Tensor, format: int, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """The rows `ids` (any shape) of `weight`, uint8 rows of `format`'s blocks of `dim`
    weights, decoded to `dtype`: `[*ids.shape, dim]`."""
    flat = ids.reshape(-1)
    qk, size = _layout(format)
    out = torch.empty(len(flat), dim, dtype=dtype, device=weight.device)
    block_k = min(256, triton.next_power_of_2(dim))
    if len(flat):
        _gguf_rows_kernel[(len(flat), triton.cdiv(dim, block_k))](
            weight,
            flat,
            out,
            dim,
            weight.stride(0),
            out.stride(0),
            FORMAT=format,
            QK=qk,
            BYTES=size,
            BLOCK_K=block_k,
        )
    return out.view(*ids.shape, dim)
