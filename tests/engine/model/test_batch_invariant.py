"""The kernels of --enable-deterministic-inference: each row of a matmul comes out the same
bits at every row count from 1 to 4,096 (the issue's test of any kernel the mode may use),
close to float64; the decode kernel's rows are independent of their neighbours and read
their request's slots through `slot_index` as they would a row of their own. The default
kernels are shown to differ across row counts, so these assertions can fail. test_quant_linear.py
runs this file again on every lower kernel path the machine has."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.model.layers.quantization import WeightFormat
from testing.quant import cases, quantized, random_weight

ROW_COUNTS = [*range(1, 34), 63, 64, 65, 255, 1000, 4096]
"""Every count a register tile could split differently, then prefill sizes."""


@pytest.fixture(autouse=True)
def kernels_built() -> None:
    assert cpu_build.available(), "the suite's machines have a compiler"


def assert_rows_invariant(matmul, x: torch.Tensor) -> torch.Tensor:
    """`matmul(x[:m])` equals the first m rows of `matmul(x)` bit for bit, for every m."""
    full = matmul(x)
    for m in ROW_COUNTS:
        part = matmul(x[:m])
        assert torch.equal(part, full[:m]), f"rows differ between {m} and {len(x)} rows"
    return full


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 100])  # 100: a tail past the last whole vector
def test_linear_rows_is_row_invariant_and_matches_float64(weight_dtype, x_dtype, k):
    generator = torch.Generator().manual_seed(k)
    weight = torch.randn(24, k, generator=generator).to(weight_dtype)
    bias = torch.randn(24, generator=generator)
    x = torch.randn(4096, k, generator=generator).to(x_dtype)
    out = assert_rows_invariant(lambda rows: cpu_ops.linear_rows(rows, weight, bias), x)
    assert out.dtype == x_dtype
    expected = x.double() @ weight.double().T + bias.double()
    tolerance = 1e-4 if x_dtype == torch.float32 else 2**-7  # bf16: one rounding of the sum
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_linear_rows_keeps_a_nan_in_its_row_and_refuses_double_weights():
    weight = torch.randn(8, 64)
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    out = cpu_ops.linear_rows(x, weight)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    with pytest.raises(RuntimeError, match="float, bf16 or half weight"):
        cpu_ops.linear_rows(x.double(), weight.double())


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("format", "n", "k"), cases([(20, 512)]))
def test_quant_linear_batch_invariant_rows_match_at_every_count(format, n, k, x_dtype):
    """bf16 x is widened to float as the weights are: float products and sums."""
    rows, dequantized = quantized(format, random_weight(n, k, seed=7))
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((4096, k)).astype(np.float32))
    x = x.to(x_dtype)

    def invariant(part: torch.Tensor) -> torch.Tensor:
        return cpu_ops.quant_linear(part, rows, int(format), None, 32, True)

    out = assert_rows_invariant(invariant, x)
    assert out.dtype == x_dtype
    expected = x.double() @ dequantized.T
    if x_dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-3)
    else:  # float sums rounded once to bf16
        torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=1e-3)


def test_the_default_quantized_rows_change_with_the_row_count():
    """What the mode removes: integer activations up to 2 rows (Q4_1's; the K-quants' up to
    16), the GEMM above 16."""
    format = WeightFormat.Q4_1
    rows, _ = quantized(format, random_weight(64, 512, seed=1))
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((64, 512)).astype(np.float32))
    alone = cpu_ops.quant_linear(x[:1], rows, int(format), None, 16)
    differing = [
        m
        for m in (2, 3, 4, 5, 17, 64)
        if not torch.equal(cpu_ops.quant_linear(x[:m], rows, int(format), None, 16)[:1], alone)
    ]
    assert differing == [3, 4, 5, 17, 64]


def test_batch_invariant_rows_keep_float_activations():
    rows, _ = quantized(WeightFormat.Q8_0, random_weight(4, 64, seed=1))
    with pytest.raises(RuntimeError, match="float activations"):
        cpu_ops.quant_linear(torch.randn(2, 64), rows, int(WeightFormat.Q8_0), None, 16, True)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16,) * 2],
)
def test_decode_attention_rows_read_their_request_row_through_slot_index(
    head_dim, q_dtype, kv_dtype
):
    """Tokens of two requests, each a query over its request's first `position + 1` slots:
    through `slot_index` the same bits as with a row of slots each, and each row the same
    alone as among the others."""
    generator = torch.Generator().manual_seed(head_dim)
    kv_heads, heads, pool = 2, 6, 300
    k_buffer = torch.randn(pool, kv_heads, head_dim, generator=generator).to(kv_dtype)
    v_buffer = torch.randn(pool, kv_heads, head_dim, generator=generator).to(kv_dtype)
    slots = torch.randperm(pool, generator=generator)[: 2 * 90].view(2, 90)
    token_req = torch.tensor([0, 0, 0, 1, 1, 0])
    seq_lens = torch.tensor([1, 17, 40, 33, 90, 90])
    q = torch.randn(len(token_req), heads, head_dim, generator=generator).to(q_dtype)
    scaling = head_dim**-0.5
    shared = cpu_ops.decode_attention(q, k_buffer, v_buffer, slots, seq_lens, scaling, token_req)
    own_rows = slots.index_select(0, token_req)
    assert torch.equal(
        shared, cpu_ops.decode_attention(q, k_buffer, v_buffer, own_rows, seq_lens, scaling)
    )
    for r in range(len(q)):
        alone = cpu_ops.decode_attention(
            q[r : r + 1],
            k_buffer,
            v_buffer,
            slots,
            seq_lens[r : r + 1],
            scaling,
            token_req[r : r + 1],
        )
        assert torch.equal(alone[0], shared[r])
    keys = k_buffer.index_select(0, own_rows[2, :40]).double()
    values = v_buffer.index_select(0, own_rows[2, :40]).double()
    group = heads // kv_heads
    scores = torch.einsum("hd,jhd->hj", q[2].double(), keys.repeat_interleave(group, 1)) * scaling
    expected = torch.einsum("hj,jhd->hd", scores.softmax(-1), values.repeat_interleave(group, 1))
    tolerance = 1e-4 if q_dtype == torch.float32 else 2**-7
    torch.testing.assert_close(shared[2].double(), expected, rtol=tolerance, atol=tolerance)


def test_decode_attention_refuses_a_slot_index_outside_slots():
    k_buffer = torch.randn(10, 1, 64)
    q = torch.randn(2, 1, 64)
    with pytest.raises(RuntimeError, match="slot_index names rows of slots"):
        cpu_ops.decode_attention(
            q,
            k_buffer,
            k_buffer,
            torch.zeros(1, 4, dtype=torch.long),
            torch.tensor([1, 1]),
            1.0,
            torch.tensor([0, 1]),
        )
