"""Sliding-window attention (`AttentionLayer.sliding_window`: a query at position p sees the
keys at (p - window, p]) in the torch backend and the CPU kernels, against the masked
reference of test_torch_backend.py in float64, with a window of 8 and contexts longer than
it. Every case is first shown to differ from full attention, so that ignoring the window
fails it; and the K/V of every key before a window is NaN where a case can make it so, so
that reading one fails it. test_quant_linear.py runs this file again on every lower kernel
path the machine has."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.model.attention.base import AttentionLayer
from engine.model.attention.torch_backend import TorchAttnBackend
from engine.model.forward_batch import ForwardBatch, ForwardMode
from engine.model.layers.quantization import WeightFormat
from testing.quant import quantized, random_weight
from tests.engine.model.attention.test_torch_backend import (
    LAYER,
    make_batch,
    reference_attention,
    run,
)
from tests.engine.model.test_graph_runner import GraphSafetyMode

WINDOW = 8
SWA = dataclasses.replace(LAYER, sliding_window=WINDOW)

CASES = {
    # (mode, prefix_lens, extend_lens)
    "decode": (ForwardMode.DECODE, [0, 3, 7, 8, 20, 40], [1] * 6),  # lengths 1 to 41
    "extend_without_prefix": (ForwardMode.EXTEND, [0, 0], [5, 30]),
    "extend_prefix_shorter_than_window": (ForwardMode.EXTEND, [3, 5], [12, 2]),
    # Chunked prefill: the chunk starts past the window's edge, keys 0..p-8 out of sight.
    "extend_chunk_past_the_window_edge": (ForwardMode.EXTEND, [20, 9, 40], [6, 17, 3]),
    "mixed": (ForwardMode.MIXED, [0, 20, 7, 50], [30, 12, 1, 1]),
}
KERNEL = pytest.mark.parametrize("cpu_kernel", [True, False], ids=["kernel", "torch-ops"])


@pytest.fixture(autouse=True)
def kernels_built() -> None:
    assert cpu_build.available(), "the suite's machines have a compiler"


def windowed_reference(fb: ForwardBatch, q, k, v, layer: AttentionLayer = SWA) -> torch.Tensor:
    """The reference under `layer`'s window, after checking that the window changes it."""
    expected = reference_attention(fb, q, k, v, layer)
    full = reference_attention(fb, q, k, v, dataclasses.replace(layer, sliding_window=None))
    assert (expected - full).abs().max() > 0.1, "the case never reaches past the window"
    return expected


def poison_keys_before_windows(fb: ForwardBatch, layer: AttentionLayer = SWA) -> None:
    """NaN in the pool at every prefix key that no new token of its request sees: the slots
    a kernel must never read (they may be freed and reused)."""
    window = layer.sliding_window
    assert window is not None
    k_buffer, v_buffer = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    table = fb.req_to_token_pool.req_to_token
    for row, prefix_len in zip(fb.req_pool_indices.tolist(), fb.prefix_lens_cpu):
        hidden = table[row, : max(prefix_len + 1 - window, 0)].long()
        k_buffer[hidden] = float("nan")
        v_buffer[hidden] = float("nan")


def close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-12) -> None:
    torch.testing.assert_close(actual.double(), expected, atol=tolerance, rtol=tolerance)


@KERNEL
@pytest.mark.parametrize("case", CASES)
def test_windowed_attention_matches_the_reference_without_reading_before_the_window(
    case, cpu_kernel
):
    fb, q, k, v = make_batch(*CASES[case], layer=SWA)
    expected = windowed_reference(fb, q, k, v)
    poison_keys_before_windows(fb)
    close(run(fb, q, k, v, cpu_kernel, SWA), expected)


@KERNEL
@pytest.mark.parametrize("case", ["decode", "mixed", "extend_chunk_past_the_window_edge"])
def test_one_batch_serves_global_layers_and_layers_of_different_windows(case, cpu_kernel):
    """One backend, metadata built once for the batch: each layer attends as its own window
    says, and each window's variant is built once, at its first layer."""
    fb, q, k, v = make_batch(*CASES[case], layer=SWA)
    layers = [LAYER, SWA, dataclasses.replace(LAYER, sliding_window=3), LAYER, SWA]
    expected = [reference_attention(fb, q, k, v, layer) for layer in layers]
    backend = TorchAttnBackend(6, 2, 16, "cpu", cpu_kernel=cpu_kernel)
    backend.init_forward_metadata(fb)
    md = backend.forward_metadata
    assert md is not None
    variants = []
    for layer, reference in zip(layers, expected):
        close(backend.forward(q, k, v, layer, fb), reference)
        variants.append(dict(md.windows))
    assert list(variants[-1]) == [(8, False), (3, False)]  # (window, over an SWA pool)
    assert variants[1][8, False] is variants[-1][8, False]


@KERNEL
@pytest.mark.parametrize("static_shapes", [True, False], ids=["captured", "compiled-op"])
def test_graph_decode_reads_only_the_window(cpu_kernel, static_shapes):
    """The graph path: metadata from device ops only, over a batch padded as the GraphRunner
    pads it (row 0, slot 0, length 1), the window's rows built inside the graph; or, under
    `torch.compile`, the opaque decode op with the layer's window."""
    fb, q, k, v = make_batch(*CASES["decode"], layer=SWA)
    n, pad = len(fb.seq_lens_cpu), 2
    expected = windowed_reference(fb, q, k, v)
    poison_keys_before_windows(fb)
    padded = dataclasses.replace(
        fb,
        req_pool_indices=torch.nn.functional.pad(fb.req_pool_indices, (0, pad)),
        seq_lens=torch.nn.functional.pad(fb.seq_lens, (0, pad), value=1),
        out_cache_loc=torch.nn.functional.pad(fb.out_cache_loc, (0, pad)),
    )
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    backend = TorchAttnBackend(6, 2, 16, "cpu", cpu_kernel=cpu_kernel)
    backend.init_cuda_graph_state(16, fb.req_to_token_pool.max_context_len, static_shapes)
    # A compiled graph's opaque op may read host values: only a recorded one is guarded.
    with GraphSafetyMode() if static_shapes else contextlib.nullcontext():
        backend.init_forward_metadata_graph(padded)
        out = backend.forward(q, k, v, SWA, padded)
    close(out[:n], expected)


def test_batch_invariant_tokens_read_only_their_windows():
    """--enable-deterministic-inference: every token of a prefill is a decode-kernel row
    over its request's first `position + 1` keys, clipped to its window; a decode batch
    hands the one-op layer the layer's window."""
    backend = TorchAttnBackend(6, 2, 16, "cpu")
    backend.batch_invariant = True
    fb, q, k, v = make_batch(*CASES["extend_chunk_past_the_window_edge"], layer=SWA)
    expected = windowed_reference(fb, q, k, v)
    poison_keys_before_windows(fb)
    backend.init_forward_metadata(fb)
    inputs = backend.cpu_decode_inputs(SWA, fb)
    assert inputs is not None and inputs.window == WINDOW and inputs.batch_invariant
    close(backend.forward(q, k, v, SWA, fb), expected)
    fb, q, k, v = make_batch(*CASES["decode"], layer=SWA)
    backend.init_forward_metadata(fb)
    windowed, full = backend.cpu_decode_inputs(SWA, fb), backend.cpu_decode_inputs(LAYER, fb)
    assert windowed is not None and windowed.window == WINDOW
    assert full is not None and full.window == 0


@KERNEL
def test_verify_tree_nodes_see_only_their_windows(cpu_kernel):
    """A verify batch of chain-shaped draft trees attends as an extend of the same tokens:
    node d of a request at position prefix + d, over the last 8 of its prefix and path."""
    fb, q, k, v = make_batch(ForwardMode.TARGET_VERIFY, [20, 3, 9], [5, 7, 2], layer=SWA)
    expected = windowed_reference(fb, q, k, v)
    poison_keys_before_windows(fb)
    width, start, ancestors = max(fb.extend_lens_cpu), 0, []
    for size in fb.extend_lens_cpu:
        for depth in range(size):
            path = list(range(start, start + depth + 1))
            ancestors.append(path + [-1] * (width - len(path)))
        start += size
    fb.tree_ancestors = torch.tensor(ancestors)
    close(run(fb, q, k, v, cpu_kernel, SWA), expected)


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


@pytest.mark.parametrize("window", [0, -1])
def test_a_window_of_zero_or_below_is_full_attention(window):
    fb, q, k, v = make_batch(*CASES["decode"])
    group = TorchAttnBackend(6, 2, 16, "cpu")
    group.init_forward_metadata(fb)
    expected = group.forward(q, k, v, LAYER, fb)
    decode = group.forward_metadata.decode
    assert decode is not None
    k_buffer, v_buffer = fb.token_to_kv_pool.get_kv_buffer(LAYER.layer_id)
    out = cpu_ops.decode_attention(
        q, k_buffer, v_buffer, decode.slots, decode.seq_lens, LAYER.scaling, window=window
    )
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        dataclasses.replace(LAYER, sliding_window=0)


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


@amx
def test_a_bf16_prefill_attends_through_the_extend_kernel_with_the_window(monkeypatch):
    layer = AttentionLayer(1, 9, 3, 64, 0.125, sliding_window=WINDOW)
    fb, q, k, v = make_batch(*CASES["mixed"], dtype=torch.bfloat16, layer=layer)
    expected = windowed_reference(fb, q, k, v, layer)
    poison_keys_before_windows(fb, layer)
    windows, kernel = [], cpu_ops.extend_attention
    monkeypatch.setattr(cpu_ops, "extend_attention", lambda *a: windows.append(a[-1]) or kernel(*a))
    close(run(fb, q, k, v, layer=layer), expected, 2e-2)
    assert windows == [WINDOW]


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
    norms = [norm, None, None, None, norm, None]
    weights = [weight for weight in projections.values() for weight in (weight, weight)]
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
            norms,
            weights,
            [int(WeightFormat.Q8_0)] * 4,
            [1] * 4,
            "silu",
            32,
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
        )

    windowed = layer(slots, seq_lens, WINDOW)
    assert torch.equal(windowed, layer(window_slots, seq_lens - first, 0))
    assert (windowed - layer(slots, seq_lens, 0)).abs().max() > 1e-3
