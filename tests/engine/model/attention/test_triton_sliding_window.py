"""Sliding-window attention in the Triton backend (under the interpreter on CPU, compiled on
CUDA), against the masked reference of test_triton_backend.py with a window of 8 and
contexts longer than it. Every case is first shown to differ from full attention, and the
K/V of every key before a window is NaN, so that ignoring the window or reading a key
before it fails the case."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engine.model.attention.triton_backend import TritonAttnBackend
from engine.model.forward_batch import ForwardMode
from tests.engine.model.attention.test_sliding_window import poison_keys_before_windows
from tests.engine.model.attention.test_triton_backend import (
    DEVICE_DTYPES,
    DEVICES,
    Batch,
    assert_close,
    make_batch,
    reference_attention,
    run,
    triton_backend,
)
from tests.engine.model.test_graph_runner import GraphSafetyMode

WINDOW = 8
HEAD_DIM = 32
EXTEND_CASES = {
    # (mode, prefix_lens, extend_lens). 45 new tokens without a prefix: query rows 32 and
    # on see no key of the first key block; a prefix of 70: the first two blocks skipped.
    "extend_chunk_past_the_window_edge": (ForwardMode.EXTEND, [0, 70, 20, 9], [45, 20, 6, 17]),
    "extend_prefix_shorter_than_window": (ForwardMode.EXTEND, [3, 0], [12, 5]),
    "mixed": (ForwardMode.MIXED, [0, 20, 7, 50], [30, 12, 1, 1]),
}
DECODE_PREFIXES = [0, 3, 7, 8, 20, 40, 99]
"""Contexts of 1 to 100 keys: shorter than the window, as long, and past it."""


def windowed_batch(
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    dtype: torch.dtype,
    device: str,
    window: int = WINDOW,
) -> tuple[Batch, torch.Tensor]:
    """A batch for a layer with `window`, its reference (checked to differ from full
    attention's), and NaN in the pool at every key before a window."""
    batch = make_batch(mode, prefix_lens, extend_lens, HEAD_DIM, dtype, device)
    batch = dataclasses.replace(
        batch, layer=dataclasses.replace(batch.layer, sliding_window=window)
    )
    expected = reference_attention(batch)
    full = dataclasses.replace(batch, layer=dataclasses.replace(batch.layer, sliding_window=None))
    assert (expected - reference_attention(full)).abs().max() > 0.1, "the window never bites"
    poison_keys_before_windows(batch.forward_batch, batch.layer)
    return batch, expected


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("case", EXTEND_CASES)
def test_windowed_extend_matches_the_reference(device, dtype, case):
    batch, expected = windowed_batch(*EXTEND_CASES[case], dtype, device)
    assert_close(run(triton_backend(HEAD_DIM, device), batch), expected, dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("min_kv_split_len", [2, 16])  # up to 4 splits of the window, or 1
def test_windowed_decode_matches_the_reference(device, dtype, min_kv_split_len):
    """The host's split counts are for the whole context; the kernel cuts the window into
    as many of them as leave none empty."""
    prefixes = DECODE_PREFIXES
    batch, expected = windowed_batch(
        ForwardMode.DECODE, prefixes, [1] * len(prefixes), dtype, device
    )
    out = run(triton_backend(HEAD_DIM, device, min_kv_split_len), batch)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_graph_decode_reads_only_the_window(device):
    """The captured path: the static split counts of the whole contexts, a batch padded as
    the GraphRunner pads it (row 0, slot 0, length 1)."""
    prefixes = DECODE_PREFIXES
    batch, expected = windowed_batch(
        ForwardMode.DECODE, prefixes, [1] * len(prefixes), torch.float32, device
    )
    fb, pad = batch.forward_batch, 3
    padded = dataclasses.replace(
        fb,
        req_pool_indices=F.pad(fb.req_pool_indices, (0, pad), value=0),
        seq_lens=F.pad(fb.seq_lens, (0, pad), value=1),
        out_cache_loc=F.pad(fb.out_cache_loc, (0, pad), value=0),
    )
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (batch.q, batch.k, batch.v))
    backend = triton_backend(HEAD_DIM, device, min_kv_split_len=2)
    backend.init_cuda_graph_state(16, fb.req_to_token_pool.max_context_len)
    with GraphSafetyMode():
        backend.init_forward_metadata_graph(padded)
    out = backend.forward(q, k, v, batch.layer, padded)
    assert_close(out[: len(prefixes)], expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "mode,prefix_lens,extend_lens",
    [
        EXTEND_CASES["mixed"],
        (ForwardMode.DECODE, DECODE_PREFIXES, [1] * len(DECODE_PREFIXES)),
    ],
    ids=["mixed", "decode"],
)
def test_one_batch_serves_global_layers_and_layers_of_different_windows(
    device, mode, prefix_lens, extend_lens
):
    batch = make_batch(mode, prefix_lens, extend_lens, HEAD_DIM, torch.float32, device)
    backend: TritonAttnBackend = triton_backend(HEAD_DIM, device, min_kv_split_len=2)
    backend.init_forward_metadata(batch.forward_batch)
    for window in (None, WINDOW, 3, None):
        layer = dataclasses.replace(batch.layer, sliding_window=window)
        layer_batch = dataclasses.replace(batch, layer=layer)
        out = backend.forward(batch.q, batch.k, batch.v, layer, batch.forward_batch)
        assert_close(out, reference_attention(layer_batch), torch.float32)
