"""Sliding windows in the CPU attention kernels (a query at position p sees the keys at
(p - window, p]) against float64 with contexts longer than the window, the K/V of every key
before a window NaN so that reading one fails the case. test_quant_linear.py runs this file
again on every lower kernel path the machine has."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.model.layers.quantization import WeightFormat
from testing.quant import quantized, random_weight

WINDOW = 8


@pytest.fixture(autouse=True)
def kernels_built() -> None:
    assert cpu_build.available(), "the suite's machines have a compiler"


def close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-12) -> None:
    torch.testing.assert_close(actual.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("layout", [(9, 3, 64), (4, 2, 48), (4, 2, 8)])  # blocked, mixed, plain
@pytest.mark.parametrize("window", [1, 8, 16, 17])
@pytest.mark.parametrize(
    "dtype, kv_dtype, tolerance",
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.bfloat16, torch.bfloat16, 2e-2),
        (torch.float32, torch.float16, 1e-5),
    ],
)
def test_decode_kernel_reads_only_each_querys_window(layout, window, dtype, kv_dtype, tolerance):
    """The kernel alone, on the head layouts that take its blocked and plain loops, lengths
    around its blocks of 8 or 16 keys: each query's last `window` keys against float64, the
    slots before them pointing at NaN K/V."""
    heads, kv_heads, head_dim = layout
    gen = torch.Generator().manual_seed(window)
    lens = [1, 7, 16, 17, 33, 100]
    pool = sum(lens) + 2
    k_buffer, v_buffer = (
        torch.randn(pool, kv_heads, head_dim, generator=gen).to(kv_dtype) for _ in range(2)
    )
    k_buffer[-1] = v_buffer[-1] = float("nan")  # the slot every key before a window names
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    slots = torch.full((len(lens), max(lens)), pool - 1)
    order, start, expected, full = torch.randperm(pool - 1, generator=gen), 0, [], []
    group = heads // kv_heads
    for r, n in enumerate(lens):
        first = max(n - window, 0)
        slots[r, first:n] = order[start : start + n - first]
        start += n - first
        keys, values = (
            b.double()[slots[r, first:n]].repeat_interleave(group, 1) for b in (k_buffer, v_buffer)
        )
        scores = torch.einsum("hd,khd->hk", q[r].double(), keys) * 0.3
        expected.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values))
    out = cpu_ops.decode_attention(
        q, k_buffer, v_buffer, slots, torch.tensor(lens), 0.3, window=window
    )
    for r in range(len(lens)):
        torch.testing.assert_close(out[r].double(), expected[r], rtol=0, atol=tolerance)
    full = cpu_ops.decode_attention(q, k_buffer, v_buffer, slots, torch.tensor(lens), 0.3)
    assert full[-1].isnan().all()  # the longest query's full context holds the NaN slot


amx = pytest.mark.skipif(
    not cpu_ops.extend_attention_available(), reason="this CPU (or kernel build) has no AMX"
)


@amx
@pytest.mark.parametrize("window", [8, 20, 70])
def test_extend_kernel_masks_each_row_to_its_window_and_skips_keys_before_it(window):
    """The AMX kernel alone, new tokens around its 16-row blocks and prefixes around its
    64-key bands (a window of 20 over 70 new tokens skips whole bands for later blocks):
    against float64 over the same bf16 inputs, the keys before the first new token's window
    NaN in the pool."""
    heads, kv_heads, head_dim = 9, 3, 64
    gen = torch.Generator().manual_seed(window)
    prefix_lens, extend_lens = [0, 5, 64, 200, 0, 17], [2, 15, 16, 17, 70, 33]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = sum(seq_lens) + 1
    k_buffer, v_buffer = (
        torch.randn(pool, kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2)
    )
    q = torch.randn(sum(extend_lens), heads, head_dim, generator=gen).bfloat16()
    slots = torch.randperm(pool, generator=gen)[: sum(seq_lens)]
    slots = torch.nn.utils.rnn.pad_sequence(list(slots.split(seq_lens)), True)
    for r, p in enumerate(prefix_lens):
        hidden = slots[r, : max(p + 1 - window, 0)]
        k_buffer[hidden] = v_buffer[hidden] = float("nan")
    q_starts = [sum(extend_lens[:r]) for r in range(len(seq_lens))]
    out = cpu_ops.extend_attention(
        q,
        k_buffer,
        v_buffer,
        slots,
        torch.tensor(prefix_lens),
        torch.tensor(extend_lens),
        torch.tensor(q_starts),
        head_dim**-0.5,
        window,
    )
    group, differs = heads // kv_heads, False
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        first = max(p + 1 - window, 0)
        keys, values = (
            b[slots[r, first : p + e]].double().repeat_interleave(group, 1)
            for b in (k_buffer, v_buffer)
        )
        positions = torch.arange(p, p + e)[:, None]
        key_positions = torch.arange(first, p + e)[None, :]
        visible = (key_positions <= positions) & (key_positions > positions - window)
        scores = torch.einsum("qhd,khd->hqk", q[q_starts[r] : q_starts[r] + e].double(), keys)
        probs = (scores * head_dim**-0.5).masked_fill(~visible, float("-inf")).softmax(-1)
        expected = torch.einsum("hqk,khd->qhd", probs, values)
        close(out[q_starts[r] : q_starts[r] + e], expected, 2e-2)
        differs |= p + e > window
    assert differs


def test_the_one_op_decode_layer_attends_over_the_window():
    """`decode_layer` with a window equals it without one over each request's last 8 slots
    alone (the rotary angles come in `cos_sin`, so only the keys differ), and differs from
    it over the whole context. Projections in Q8_0 under float32: every kernel path runs it."""
    heads, kv_heads, head_dim, hidden_size = 4, 2, 16, 64
    gen = torch.Generator().manual_seed(0)
    sizes = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden_size), "o": (hidden_size, 64)}
    sizes |= {"gate_up": (128, hidden_size), "down": (hidden_size, 64)}
    projections = {
        name: quantized(WeightFormat.Q8_0, random_weight(n, k, seed=n + k))[0]
        for name, (n, k) in sizes.items()
    }
    norm = torch.ones(hidden_size)
    weights = [norm, *[projections["qkv"]] * 2, *[projections["o"]] * 2, norm]
    weights += [*[projections["gate_up"]] * 2, *[projections["down"]] * 2]
    lens = [3, 12, 30]
    pool = sum(lens) + 1
    k_buffer, v_buffer = (torch.randn(pool, kv_heads, head_dim, generator=gen) for _ in range(2))
    slots = torch.randperm(pool - 1, generator=gen)[: sum(lens)] + 1
    slots = torch.nn.utils.rnn.pad_sequence(list(slots.split(lens)), True)
    seq_lens = torch.tensor(lens)
    out_cache_loc = slots[torch.arange(len(lens)), seq_lens - 1]
    hidden = torch.randn(len(lens), hidden_size, generator=gen)
    cos_sin = torch.randn(len(lens), 2, 1, head_dim, generator=gen)
    first = (seq_lens - WINDOW).clamp(min=0)
    window_slots = torch.stack([slots[r, f : f + WINDOW] for r, f in enumerate(first.tolist())])

    def layer(slots: torch.Tensor, seq_lens: torch.Tensor, window: int) -> torch.Tensor:
        return cpu_ops.decode_layer(
            hidden.clone(),
            None,
            weights,
            cos_sin,
            k_buffer,
            v_buffer,
            out_cache_loc,
            slots,
            seq_lens,
            None,
            False,
            window,
            heads,
            kv_heads,
            head_dim**-0.5,
            1e-6,
            [int(WeightFormat.Q8_0)] * 4,
            32,
        )

    windowed = layer(slots, seq_lens, WINDOW)
    assert torch.equal(windowed, layer(window_slots, seq_lens - first, 0))
    assert (windowed - layer(slots, seq_lens, 0)).abs().max() > 1e-3
