"""The Triton GGUF matmul (engine/kernels/triton/gguf_matmul.py) against cuBLAS's bf16
matmul of the same weights dequantized, at Gemma-3-270M's decode shapes: the Q8_0 LM head
(262144 x 640) and a Q5_0 gate or up projection (2048 x 640), for a decode row and a few.
Each line gives the time and the bytes read per second (weights, x and the output), and the
largest difference between the two outputs relative to the largest output.

Run (CUDA only): python -m benchmarks.gguf_cuda [--rows 1 8 64]
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from engine.kernels.triton.gguf_matmul import gguf_embedding, gguf_linear
from engine.model.layers.quantization import WeightFormat
from testing.quant import random_blocks

SHAPES = [
    ("lm_head", WeightFormat.Q8_0, 262144, 640),
    ("gate_up", WeightFormat.Q5_0, 2048, 640),
]
"""(name, format, output rows N, input width K)."""


def gbs(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def compare(
    x: torch.Tensor, blocks: torch.Tensor, format: WeightFormat, dense: torch.Tensor
) -> str:
    """One line: `x @ W^T` from the blocks and from the bf16 weights, timed."""
    n, k = dense.shape
    io = (x.numel() + len(x) * n) * 2
    ms_gguf = triton.testing.do_bench(lambda: gguf_linear(x, blocks, int(format)))
    ms_bf16 = triton.testing.do_bench(lambda: x @ dense.T)
    expected = (x @ dense.T).float()
    diff = (gguf_linear(x, blocks, int(format)).float() - expected).abs().max()
    return (
        f"{format.name} N={n} K={k} M={len(x)}: "
        f"triton {ms_gguf * 1e3:.1f} us {gbs(blocks.numel() + io, ms_gguf):.0f} GB/s | "
        f"bf16 {ms_bf16 * 1e3:.1f} us {gbs(dense.numel() * 2 + io, ms_bf16):.0f} GB/s | "
        f"speedup {ms_bf16 / ms_gguf:.2f}x | max diff {diff / expected.abs().max():.1e}"
    )


def bench(name: str, format: WeightFormat, n: int, k: int, rows: list[int]) -> None:
    blocks = random_blocks(format, n, k, seed=0).cuda()
    ids = torch.arange(n, device="cuda")
    dense = gguf_embedding(blocks, ids, int(format), k, torch.bfloat16)
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        print(name, compare(x, blocks, format, dense), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for shape in SHAPES:
        bench(*shape, args.rows)


if __name__ == "__main__":
    main()
