"""The backends over a hybrid model's two pools (`SWAKVPool`): a sliding layer reads and
writes its K/V in the SWA pool through `full_to_swa_index_mapping`, a full layer in the
full pool, in one batch. The SWA rows are a random permutation of the slots and the rows
of keys before each window map to a NaN row, so that reading a sliding layer's keys
untranslated, or reading one whose SWA slot was freed, fails the case."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engine.mem.swa_allocator import SWATokenToKVPoolAllocator
from engine.mem.swa_kv_pool import SWAKVPool
from engine.model.attention.base import AttentionLayer
from engine.model.attention.torch_backend import TorchAttnBackend
from engine.model.forward_batch import ForwardBatch, ForwardMode
from tests.engine.model.attention import test_triton_backend as triton_tests
from tests.engine.model.attention.test_sliding_window import CASES, KERNEL, SWA, close
from tests.engine.model.attention.test_torch_backend import make_batch, reference_attention
from tests.engine.model.test_graph_runner import GraphSafetyMode

GLOBAL = dataclasses.replace(SWA, layer_id=0, sliding_window=None)


def over_swa_pool(fb: ForwardBatch, window: int, swa_layer: int = 1) -> ForwardBatch:
    """`fb` with its pool's K/V moved into an `SWAKVPool` whose layer `swa_layer` slides:
    that layer's rows permuted through the mapping, and every key no new token of its
    request sees (before its `window`) mapped to a NaN row, as if freed and reused."""
    pool = fb.token_to_kv_pool
    gen = torch.Generator().manual_seed(1)
    allocator = SWATokenToKVPoolAllocator(pool.size, pool.size + 1, pool.device)
    mapping = allocator.full_to_swa_index_mapping
    mapping[1:] = torch.randperm(pool.size, generator=gen) + 1
    swa_layers = [layer_id == swa_layer for layer_id in range(2)]
    k_shape = pool.get_kv_buffer(0)[0].shape
    swa = SWAKVPool(
        pool.size, pool.size + 1, pool.dtype, *k_shape[1:], swa_layers, mapping, pool.device
    )
    for layer_id in range(2):
        for old, new in zip(pool.get_kv_buffer(layer_id), swa.get_kv_buffer(layer_id)):
            rows = mapping if swa_layers[layer_id] else torch.arange(pool.size + 1)
            new[rows] = old
    nan_row = pool.size + 1
    for buffer in swa.get_kv_buffer(swa_layer):
        buffer[nan_row] = float("nan")
    table = fb.req_to_token_pool.req_to_token
    for row, prefix_len in zip(fb.req_pool_indices.tolist(), fb.prefix_lens_cpu):
        mapping[table[row, : max(prefix_len + 1 - window, 0)].long()] = nan_row
    return dataclasses.replace(fb, token_to_kv_pool=swa)


def hybrid_batch(case: str) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    fb, q, k, v = make_batch(*CASES[case], layer=SWA)
    gen = torch.Generator().manual_seed(2)
    for buffer in fb.token_to_kv_pool.get_kv_buffer(GLOBAL.layer_id):
        buffer.copy_(torch.randn(buffer.shape, generator=gen, dtype=torch.float64))
    return fb, q, k, v


def assert_written_through_the_mapping(fb: ForwardBatch, k: torch.Tensor) -> None:
    pool = fb.token_to_kv_pool
    assert isinstance(pool, SWAKVPool)
    rows = pool.full_to_swa_index_mapping[fb.out_cache_loc]
    close(pool.get_kv_buffer(SWA.layer_id)[0][rows], k.double())
    close(pool.get_kv_buffer(GLOBAL.layer_id)[0][fb.out_cache_loc], k.double())


@KERNEL
@pytest.mark.parametrize("case", CASES)
def test_sliding_layers_attend_over_the_swa_pool_and_global_layers_over_the_full_one(
    case, cpu_kernel
):
    fb, q, k, v = hybrid_batch(case)
    expected = {layer: reference_attention(fb, q, k, v, layer) for layer in (GLOBAL, SWA)}
    fb = over_swa_pool(fb, SWA.sliding_window or 0)
    backend = TorchAttnBackend(6, 2, 16, "cpu", cpu_kernel=cpu_kernel)
    backend.init_forward_metadata(fb)
    for layer in (GLOBAL, SWA, GLOBAL, SWA):
        close(backend.forward(q, k, v, layer, fb), expected[layer])
    assert_written_through_the_mapping(fb, k)


@KERNEL
@pytest.mark.parametrize("static_shapes", [True, False], ids=["captured", "compiled-op"])
def test_graph_decode_translates_inside_the_graph(cpu_kernel, static_shapes):
    fb, q, k, v = hybrid_batch("decode")
    expected = reference_attention(fb, q, k, v, SWA)
    fb = over_swa_pool(fb, SWA.sliding_window or 0)
    n, pad = len(fb.seq_lens_cpu), 2
    padded = dataclasses.replace(
        fb,
        req_pool_indices=F.pad(fb.req_pool_indices, (0, pad)),
        seq_lens=F.pad(fb.seq_lens, (0, pad), value=1),
        out_cache_loc=F.pad(fb.out_cache_loc, (0, pad)),
    )
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    backend = TorchAttnBackend(6, 2, 16, "cpu", cpu_kernel=cpu_kernel)
    backend.init_cuda_graph_state(16, fb.req_to_token_pool.max_context_len, static_shapes)
    with GraphSafetyMode() if static_shapes else contextlib.nullcontext():
        backend.init_forward_metadata_graph(padded)
        out = backend.forward(q, k, v, SWA, padded)
    close(out[:n], expected)


def test_one_op_decode_layers_get_the_swa_pools_slots():
    """The inputs of `cpu_ops.decode_layer` (which writes K/V itself): a sliding layer's
    buffers, new-token rows and key slots are the SWA pool's."""
    fb, _, _, _ = hybrid_batch("decode")
    fb = over_swa_pool(fb, SWA.sliding_window or 0)
    pool = fb.token_to_kv_pool
    assert isinstance(pool, SWAKVPool)
    backend = TorchAttnBackend(6, 2, 16, "cpu")
    backend.init_forward_metadata(fb)
    windowed, full = backend.cpu_decode_inputs(SWA, fb), backend.cpu_decode_inputs(GLOBAL, fb)
    assert windowed is not None and full is not None
    mapping = pool.full_to_swa_index_mapping
    assert windowed.k_buffer is pool.get_kv_buffer(SWA.layer_id)[0]
    assert torch.equal(windowed.out_cache_loc, mapping[fb.out_cache_loc])
    assert torch.equal(windowed.slots, mapping[full.slots])
    assert torch.equal(full.out_cache_loc, fb.out_cache_loc)


TRITON_CASES = {
    "extend": (ForwardMode.EXTEND, [0, 70, 20, 9], [45, 20, 6, 17]),
    "mixed": (ForwardMode.MIXED, [0, 20, 7, 50], [30, 12, 1, 1]),
    "decode": (ForwardMode.DECODE, [0, 3, 7, 8, 20, 40, 99], [1] * 7),
}


@pytest.mark.parametrize("device", triton_tests.DEVICES)
@pytest.mark.parametrize(
    ("case", "graph"),
    [("extend", False), ("mixed", False), ("decode", False), ("decode", True)],
    ids=["extend", "mixed", "decode", "decode-graph"],  # graphs capture decode batches only
)
def test_triton_translates_the_sliding_layers_slots_once_per_batch(device, case, graph):
    head_dim = 32
    batch = triton_tests.make_batch(*TRITON_CASES[case], head_dim, torch.float32, device)
    swa_layer = dataclasses.replace(batch.layer, sliding_window=8)
    global_layer = dataclasses.replace(batch.layer, layer_id=0)
    layers: list[AttentionLayer] = [global_layer, swa_layer, global_layer, swa_layer]
    expected = [
        triton_tests.reference_attention(dataclasses.replace(batch, layer=layer))
        for layer in layers
    ]
    fb = over_swa_pool(batch.forward_batch, 8)
    backend = triton_tests.triton_backend(head_dim, device, min_kv_split_len=2)
    if graph:
        backend.init_cuda_graph_state(16, fb.req_to_token_pool.max_context_len)
        with GraphSafetyMode():
            backend.init_forward_metadata_graph(fb)
    else:
        backend.init_forward_metadata(fb)
    for layer, reference in zip(layers, expected):
        out = backend.forward(batch.q, batch.k, batch.v, layer, fb)
        triton_tests.assert_close(out, reference, torch.float32)
