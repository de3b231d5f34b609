"""The quantized matmul (`csrc/quant_linear.cpp`) against float64, for each weight format,
each activation mode (float, int16, int8), the decode rows' register path and the
prefill's band path; and the same tests again under every lower kernel path this machine
can execute (a subprocess with `RADIXSERVE_CPU_ISA`: an AVX-512 machine checks its AVX2
build too)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.isa import ATEN_CAPABILITY, FORCE_ENV, FORCEABLE, PATHS, cpu_isa
from engine.model.layers.quantization import (
    WeightFormat,
    row_bytes,
)
from testing.quant import cases, quantized, random_weight

GEMV_ROWS = 16
"""Up to this many rows of x the kernel's register path runs (kGemvRows), beyond, the bands."""


def largest_integer(format: WeightFormat, bits: int) -> int:
    """What a block of x rounds to at `bits`: Q6_K's int16 keeps one bit less, so that its
    products times its 8-bit sub-block scales still sum exactly in int32."""
    return 2**14 - 1 if format == WeightFormat.Q6_K and bits == 16 else 2 ** (bits - 1) - 1


@pytest.fixture(autouse=True)
def kernels_built() -> None:
    assert cpu_build.available(), "the suite's machines have a compiler"


@pytest.mark.parametrize(
    ("format", "n", "k"),
    cases([(33, 32), (100, 576), (7, 1536), (130, 64), (5, 512), (24, 640), (9, 2048)]),
)
def test_dequantize_reads_the_blocks_as_gguf_does(format, n, k):
    rows, expected = quantized(format, random_weight(n, k, seed=n + k))
    assert rows.shape == (n, row_bytes(format, k))
    out = cpu_ops.quant_dequantize(rows, int(format), k)
    assert out.dtype == torch.float32 and torch.equal(out.double(), expected.float().double())


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 12, GEMV_ROWS, GEMV_ROWS + 1, 70])
@pytest.mark.parametrize(
    ("format", "n", "k"), cases([(33, 32), (200, 576), (9, 1536), (64, 128), (40, 768)])
)
def test_float_activations_match_float64(format, rows, n, k):
    weight, reference = quantized(format, random_weight(n, k, seed=rows * n + k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    expected = x.double() @ reference.T
    out = cpu_ops.quant_linear(x, weight, int(format))
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    # float32 sums of k products: each within k float32 roundings of the largest partial sum
    bound = k * 2.0**-24 * (x.double().abs() @ reference.abs().T)
    assert ((out.double() - expected).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("bits", [16, 8])
# rows: tiles of one and two rows of x; n: tiles of 8 weight rows, with tails
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, GEMV_ROWS])
@pytest.mark.parametrize(
    ("format", "n", "k"), cases([(33, 32), (200, 576), (9, 1536), (18, 64), (6, 512)])
)
def test_integer_activations_are_within_their_rounding_of_float64(format, bits, rows, n, k):
    """Each block of 32 values of x rounds to integers with step max|x| / its largest integer
    (2^(bits-1) - 1, Q6_K's int16 2^14 - 1): the result may move by half a step times the
    block's |w| sums, and no more."""
    weight, reference = quantized(format, random_weight(n, k, seed=rows + n * k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    x[0, :5] = torch.tensor([0.0, -0.0, 1e-30, -7.5, 3e-39])  # zeros, a denormal, a large one
    expected = x.double() @ reference.T
    out = cpu_ops.quant_linear(x, weight, int(format), None, bits)
    blocks = x.double().view(rows, k // 32, 32)
    half_step = blocks.abs().amax(dim=2) / largest_integer(format, bits) / 2  # [rows, blocks]
    w_sums = reference.abs().view(n, k // 32, 32).sum(dim=2)  # [n, blocks]
    bound = half_step @ w_sums.T * (1 + 1e-5) + k * 2.0**-22 * (
        x.double().abs() @ reference.abs().T
    )
    assert ((out.double() - expected).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("bits", [16, 8])
def test_integer_activations_of_a_zero_block_contribute_nothing(bits):
    weight, _ = quantized(WeightFormat.Q4_1, random_weight(8, 64, seed=1))
    x = torch.zeros(1, 64)
    out = cpu_ops.quant_linear(x, weight, int(WeightFormat.Q4_1), None, bits)
    assert torch.equal(out, torch.zeros(1, 8))


@pytest.mark.parametrize("bits", [16, 8])
def test_a_nan_in_x_reaches_every_output_of_its_row(bits):
    weight, _ = quantized(WeightFormat.Q4_1, random_weight(8, 64, seed=2))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    x[1, 40] = float("nan")
    out = cpu_ops.quant_linear(x, weight, int(WeightFormat.Q4_1), None, bits)
    assert out[0].isfinite().all() and out[1].isnan().all()


def test_activation_bits_other_than_32_16_8_are_refused():
    weight, _ = quantized(WeightFormat.Q4_1, random_weight(8, 64, seed=1))
    with pytest.raises(RuntimeError, match="32 \\(float\\), 16 or 8 bits, got 12"):
        cpu_ops.quant_linear(torch.zeros(1, 64), weight, int(WeightFormat.Q4_1), None, 12)


@pytest.mark.parametrize("activation_bits", [32, 16, 8])
@pytest.mark.parametrize("rows", [3, GEMV_ROWS + 4])
def test_bf16_input_is_the_float_product_plus_bias_rounded_once(activation_bits, rows):
    weight, _ = quantized(WeightFormat.Q8_0, random_weight(48, 96, seed=5))
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 96, generator=gen).bfloat16(), torch.randn(48, generator=gen)
    out = cpu_ops.quant_linear(x, weight, int(WeightFormat.Q8_0), bias, activation_bits)
    as_float = cpu_ops.quant_linear(
        x.float(), weight, int(WeightFormat.Q8_0), None, activation_bits
    )
    assert out.dtype == torch.bfloat16
    if rows <= GEMV_ROWS:  # float sums, the bias added, one rounding
        assert torch.equal(out, (as_float + bias).bfloat16())
    else:  # the band path multiplies in bf16 (the CPU's bf16 GEMM where it has one)
        torch.testing.assert_close(out.float(), as_float + bias, rtol=2e-2, atol=5e-2)


GEMMA_SHAPES = [(256, 640), (2048, 640), (1024, 2048)]
"""Gemma 3 270M's (N, K): rows of 640, 20 blocks of 32 (no whole 64, 128 or 256), and 2048."""


@functools.cache
def gemma_weight(format: WeightFormat, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantized(format, random_weight(n, k, seed=n + k))


# (rows, activation bits): the integer tiles (one and two rows; the K-quants' up to 16, four
# rows a pass), the float register path, the prefill bands
@pytest.mark.parametrize(
    ("rows", "bits"),
    [
        (1, 32),
        (1, 16),
        (1, 8),
        (2, 16),
        (2, 8),
        (4, 16),
        (GEMV_ROWS, 32),
        (GEMV_ROWS, 16),
        (40, 32),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("format", "n", "k"), cases(GEMMA_SHAPES))
def test_gemma_shapes_match_float64_on_every_route(format, n, k, rows, bits, dtype):
    """K = 640 is a whole number of blocks of 32 but not of 64 or more: no route may assume
    wider steps. Bounds: float32 sums (k roundings), x's rounding to `bits` per block (half a
    step times the block's |w|), and for bf16 the output's rounding and the bands' bf16
    weights (each product within 2^-8)."""
    weight, reference = gemma_weight(format, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k)).to(dtype)
    out = cpu_ops.quant_linear(x, weight, int(format), None, bits)
    assert out.dtype == dtype and out.shape == (rows, n)
    xd = x.double()
    expected = xd @ reference.T
    magnitude = xd.abs() @ reference.abs().T
    bound = k * 2.0**-22 * magnitude
    if bits != 32:
        half_step = xd.view(rows, k // 32, 32).abs().amax(dim=2) / largest_integer(format, bits) / 2
        bound += half_step @ reference.abs().view(n, k // 32, 32).sum(dim=2).T * (1 + 1e-5)
    if dtype == torch.bfloat16:
        bound += 2.0**-8 * (magnitude + expected.abs() + bound)
    assert ((out.double() - expected).abs() <= bound + 1e-30).all()


def test_nan_in_a_row_of_x_stays_in_that_row():
    weight, _ = quantized(WeightFormat.Q4_0, random_weight(16, 64, seed=3))
    x = torch.randn(2, 64)
    x[1, 10] = float("nan")
    out = cpu_ops.quant_linear(x, weight, int(WeightFormat.Q4_0))
    assert out[1].isnan().all() and not out[0].isnan().any()


def test_weights_of_the_wrong_width_are_refused():
    weight, _ = quantized(WeightFormat.Q4_1, random_weight(4, 64, seed=0))
    with pytest.raises(RuntimeError, match="uint8 weight rows of 60 bytes"):
        cpu_ops.quant_linear(torch.randn(1, 96), weight, int(WeightFormat.Q4_1))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops.quant_linear(torch.randn(1, 40), weight, int(WeightFormat.Q4_1))


LOWER_PATHS = [path for path in FORCEABLE if PATHS.index(path) < PATHS.index(cpu_isa().path)]


@pytest.mark.skipif(
    bool(os.environ.get(FORCE_ENV)) or not LOWER_PATHS,
    reason="this process runs the machine's only vector path (CI's AVX2 machines)",
)
@pytest.mark.parametrize("path", LOWER_PATHS)
def test_lower_kernel_paths_pass_the_same_tests(path):
    """This file, the layer kernels' and the attention kernels' tests again, with the kernels
    (and ATen) forced down to `path`: an AVX-512 machine also checks what an AVX2 machine
    runs."""
    here = os.path.dirname(__file__)
    model_tests = os.path.join(here, os.pardir, os.pardir, "model")
    files = [
        __file__,
        os.path.join(here, "test_ops.py"),
        os.path.join(model_tests, "test_batch_invariant.py"),
        os.path.join(model_tests, "attention", "test_torch_backend.py"),
        os.path.join(model_tests, "attention", "test_sliding_window.py"),
    ]
    env = {**os.environ, FORCE_ENV: path, "ATEN_CPU_CAPABILITY": ATEN_CAPABILITY.get(path, "")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
        env={**env, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
