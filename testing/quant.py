"""Quantized weights for the kernel tests and benchmarks: GGUF blocks of random or real
weights laid out as llama.cpp lays them (gguf-py's quantizer, and a plain one for the
K-quants, which gguf-py only dequantizes), with the float64 weights they hold; and blocks
of random bytes, which set every bit of every field."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from engine.model.layers.quantization import (
    BLOCK_LAYOUTS,
    WeightFormat,
    quantize_int8_rows,
    row_bytes,
)


def quantize_blocks(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """`data` (float32, rows of a multiple of the block) in `kind`'s blocks, uint8 rows:
    gguf-py's quantizer, and for the K-quants (which gguf-py only dequantizes) a plain one
    of this test's: each sub-block's range to 4, 5 or 6 bits, the sub-block scales to 6 or 8
    bits of the super-block's. Not llama.cpp's search for the best scales, but blocks laid
    out as llama.cpp's, which gguf-py dequantizes."""
    if kind == gguf.GGMLQuantizationType.Q4_K:
        return _quantize_q45_k(data, bits=4)
    if kind == gguf.GGMLQuantizationType.Q5_K:
        return _quantize_q45_k(data, bits=5)
    if kind == gguf.GGMLQuantizationType.Q6_K:
        return _quantize_q6_k(data)
    return gguf.quants.quantize(data, kind)


def _half(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _quantize_q45_k(data: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K, or Q5_K (`bits` 5): the same super-block, each weight's fifth bit in 32 bytes
    after the factors (bit j of byte l: weight l of sub-block j)."""
    rows, k = data.shape
    top = (1 << bits) - 1
    w = data.reshape(rows, k // 256, 8, 32).astype(np.float32)
    low = np.minimum(w.min(axis=-1), 0.0)  # w = d * sc * q - dmin * m, m >= 0
    scale = (w.max(axis=-1) - low) / top
    d = np.maximum(scale.max(axis=-1), 1e-8) / 63
    dmin = np.maximum((-low).max(axis=-1), 1e-8) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.ceil(scale / d[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.ceil(-low / dmin[..., None]), 0, 63).astype(np.uint8)
    step = (d[..., None] * sc.astype(np.float32))[..., None]
    offset = (dmin[..., None] * m.astype(np.float32))[..., None]
    q = np.clip(np.rint((w + offset) / step), 0, top).astype(np.uint8)  # [rows, sb, 8, 32]
    packed = np.empty((rows, k // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((m[..., 4:8] & 0x0F) << 4)
    low4 = q & 0x0F
    nibbles = low4[..., 0::2, :] | (low4[..., 1::2, :] << 4)  # sub-blocks 2i (low), 2i + 1
    parts = [_half(d), _half(dmin), packed]
    if bits == 5:
        fifth = (q >> 4) << np.arange(8, dtype=np.uint8)[:, None]  # [rows, sb, 8, 32]
        parts.append(np.bitwise_or.reduce(fifth, axis=-2))
    blocks = np.concatenate([*parts, nibbles.reshape(rows, k // 256, 128)], axis=-1)
    return blocks.reshape(rows, -1)


def _quantize_q6_k(data: np.ndarray) -> np.ndarray:
    rows, k = data.shape
    w = data.reshape(rows, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(w).max(axis=-1) / 31
    d = np.maximum(np.abs(scale).max(axis=-1), 1e-8) / 127
    d = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.ceil(scale / d[..., None]), 1, 127).astype(np.int8)
    step = (d[..., None] * sc.astype(np.float32))[..., None]
    q = (np.clip(np.rint(w / step), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, k // 256, 2, 4, 32)  # per half of 128: 4 runs of 32
    lo, hi = q & 0x0F, q >> 4
    ql = np.concatenate(
        [lo[:, :, :, 0] | (lo[:, :, :, 2] << 4), lo[:, :, :, 1] | (lo[:, :, :, 3] << 4)], axis=-1
    )
    qh = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
    blocks = np.concatenate(
        [
            ql.reshape(rows, k // 256, 128),
            qh.reshape(rows, k // 256, 64),
            sc.view(np.uint8).reshape(rows, k // 256, 16),
            _half(d),
        ],
        axis=-1,
    )
    return blocks.reshape(rows, -1)


def quantized(format: WeightFormat, weight: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` in `format` (uint8 rows) and the float64 weights those rows hold."""
    if format is WeightFormat.INT8:
        rows = quantize_int8_rows(torch.from_numpy(weight))
        k = weight.shape[1]
        q = rows[:, :k].view(torch.int8).double()
        scale = rows[:, k:].contiguous().view(torch.float32).double()
        return rows, q * scale
    blocks = quantize_blocks(weight, gguf.GGMLQuantizationType(int(format)))
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(int(format)))
    rows = torch.from_numpy(blocks.view(np.uint8).reshape(weight.shape[0], -1).copy())
    return rows, torch.from_numpy(reference).double()


FACTORS_AT = {
    WeightFormat.Q4_0: (0,),
    WeightFormat.Q4_1: (0, 2),
    WeightFormat.Q5_0: (0,),
    WeightFormat.Q5_1: (0, 2),
    WeightFormat.Q8_0: (0,),
    WeightFormat.Q4_K: (0, 2),
    WeightFormat.Q5_K: (0, 2),
    WeightFormat.Q6_K: (208,),
}
"""Where each GGUF block holds its float16 factors (d, and m or dmin)."""


def random_blocks(format: WeightFormat, n: int, k: int, seed: int) -> torch.Tensor:
    """`[n, row bytes]` of random bytes, every bit field (nibbles, fifth bits, the
    K-quants' packed 6-bit scales and mins, Q6_K's int8 scales) at random, the float16
    factors finite: a decode that takes any field from the wrong bits disagrees with
    gguf-py's."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, (n, row_bytes(format, k)), dtype=np.uint8)
    block_weights, block_bytes = BLOCK_LAYOUTS[format]
    blocks = rows.reshape(n, k // block_weights, block_bytes)
    for at in FACTORS_AT[format]:
        factors = rng.uniform(-0.05, 0.05, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, at : at + 2] = factors.view(np.uint8).reshape(*factors.shape, 2)
    return torch.from_numpy(rows)


def random_weight(n: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)


def cases(shapes: list[tuple[int, int]]) -> list[tuple[WeightFormat, int, int]]:
    """Each format with each (n, k) whose k is a whole number of the format's blocks (256
    weights for the K-quants, 32 for the others)."""
    return [
        (format, n, k)
        for format in WeightFormat
        for n, k in shapes
        if k % BLOCK_LAYOUTS.get(format, (32,))[0] == 0
    ]
