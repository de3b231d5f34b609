"""The Triton backend against a plain-torch reference and against the torch (SDPA) backend.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports Triton). The interpreter is about 1000x slower
than torch and its bf16 `tl.dot` is wrong, so CPU cases use small shapes in fp32 and fp16.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

from engine.kernels.triton import extend_attention
from engine.mem.kv_pool import MHATokenToKVPool
from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.model.attention.base import AttentionBackend, AttentionLayer
from engine.model.attention.torch_backend import TorchAttnBackend
from engine.model.attention.triton_backend import (
    DecodeMetadata,
    TritonAttnBackend,
    get_num_kv_splits,
)
from engine.model.forward_batch import ForwardBatch, ForwardMode
from tests.engine.model.test_graph_runner import GraphSafetyMode

INTERPRETED = isinstance(extend_attention._fwd_kernel, InterpretedFunction)

NUM_HEADS, NUM_KV_HEADS = 4, 2
LAYER_NUM = 2
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# Without CUDA, the kernels must have been decorated after TRITON_INTERPRET=1 was set.
assert torch.cuda.is_available() or INTERPRETED, (
    "engine.kernels.triton was imported before TRITON_INTERPRET=1 was set; "
    "set it in tests/conftest.py"
)
DEVICE_MARKS = {
    "cpu": pytest.mark.skipif(
        not INTERPRETED, reason="CUDA is present, so the kernels are compiled for it"
    ),
    "cuda": pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
}
DEVICES = [pytest.param(device, marks=mark) for device, mark in DEVICE_MARKS.items()]
# The interpreter's bf16 tl.dot is wrong, so bf16 runs on CUDA only.
DEVICE_DTYPES = [
    pytest.param(
        device,
        dtype,
        id=f"{device}-{str(dtype).removeprefix('torch.')}",
        marks=DEVICE_MARKS[device],
    )
    for device, dtype in [
        ("cpu", torch.float32),
        ("cpu", torch.float16),
        ("cuda", torch.float32),
        ("cuda", torch.float16),
        ("cuda", torch.bfloat16),
    ]
]


@dataclass
class Batch:
    """A ForwardBatch plus the new tokens' q/k/v that one attention layer receives."""

    forward_batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layer: AttentionLayer


def make_batch(
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    head_dim: int,
    dtype: torch.dtype,
    device: str,
) -> Batch:
    """Ragged requests on scattered pool slots: prefixes are in the pool and in `req_to_token`,
    new tokens only in `out_cache_loc` (their table entries are left stale on purpose)."""
    gen = torch.Generator().manual_seed(0)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool_size = sum(seq_lens) + 17
    kv_pool = MHATokenToKVPool(pool_size, dtype, NUM_KV_HEADS, head_dim, LAYER_NUM, device)
    req_pool = ReqToTokenPool(len(seq_lens) + 3, max(seq_lens) + 5, device)
    for layer_id in range(LAYER_NUM):
        for buffer in kv_pool.get_kv_buffer(layer_id):
            buffer.copy_(torch.randn(buffer.shape, generator=gen).to(dtype))

    slots = (torch.randperm(pool_size, generator=gen)[: sum(seq_lens)] + 1).to(device)
    rows = torch.randperm(req_pool.size, generator=gen)[: len(seq_lens)] + 1
    out_cache_loc, start = [], 0
    for row, prefix_len, seq_len in zip(rows.tolist(), prefix_lens, seq_lens):
        req_pool.write(row, 0, slots[start : start + prefix_len])
        out_cache_loc.append(slots[start + prefix_len : start + seq_len])
        start += seq_len

    num_tokens = sum(extend_lens)
    forward_batch = ForwardBatch(
        forward_mode=mode,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]).to(
            device
        ),
        req_pool_indices=rows.to(device),
        seq_lens=torch.tensor(seq_lens, device=device),
        prefix_lens=torch.tensor(prefix_lens, device=device),
        extend_lens=torch.tensor(extend_lens, device=device),
        out_cache_loc=torch.cat(out_cache_loc),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=prefix_lens,
        extend_lens_cpu=extend_lens,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
    )
    q, k, v = (
        torch.randn(num_tokens, heads, head_dim, generator=gen).to(device, dtype)
        for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)
    )
    layer = AttentionLayer(1, NUM_HEADS, NUM_KV_HEADS, head_dim, head_dim**-0.5)
    return Batch(forward_batch, q, k, v, layer)


def reference_attention(batch: Batch) -> torch.Tensor:
    """softmax(QK^T)V per request in float64, keys gathered by hand, causal over positions
    (and within the layer's sliding window, if it has one)."""
    fb, layer = batch.forward_batch, batch.layer
    k_buffer, v_buffer = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    group = layer.num_heads // layer.num_kv_heads
    outputs, start = [], 0
    for row, prefix_len, extend_len in zip(
        fb.req_pool_indices.tolist(), fb.prefix_lens_cpu, fb.extend_lens_cpu
    ):
        new = slice(start, start + extend_len)
        prefix_slots = fb.req_to_token_pool.req_to_token[row, :prefix_len].long()
        k = torch.cat([k_buffer[prefix_slots], batch.k[new]]).double().repeat_interleave(group, 1)
        v = torch.cat([v_buffer[prefix_slots], batch.v[new]]).double().repeat_interleave(group, 1)
        q = batch.q[new].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * layer.scaling
        q_pos = torch.arange(prefix_len, prefix_len + extend_len, device=q.device)[:, None]
        k_pos = torch.arange(prefix_len + extend_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if layer.sliding_window is not None:  # (p - window, p]
            visible &= k_pos > q_pos - layer.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += extend_len
    return torch.cat(outputs)


def run(backend: AttentionBackend, batch: Batch) -> torch.Tensor:
    backend.init_forward_metadata(batch.forward_batch)
    return backend.forward(batch.q, batch.k, batch.v, batch.layer, batch.forward_batch)


def triton_backend(head_dim: int, device: str, min_kv_split_len: int = 16) -> TritonAttnBackend:
    """Short splits so that the small CPU shapes still exercise several KV splits and the cap."""
    return TritonAttnBackend(
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        device=device,
        max_kv_splits=4,
        min_kv_split_len=min_kv_split_len,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected.double(), atol=TOL[dtype], rtol=TOL[dtype])


HEAD_DIMS = [32, 40, 64]  # 40: the head axis is padded to a power of two and masked
EXTEND_CASES = {
    # (mode, prefix_lens, extend_lens): empty and long prefixes, one-token extends, query and
    # key tiles that cross block boundaries (BLOCK_M = 64, BLOCK_N = 32 or 64).
    "ragged": (ForwardMode.EXTEND, [0, 45, 70, 0, 13], [37, 1, 20, 1, 66]),
    "mixed": (ForwardMode.MIXED, [0, 20, 7, 50], [30, 12, 1, 1]),
}
DECODE_CASES = {
    # (min_kv_split_len, prefix_lens): with 16, the requests get 1, 1, 3, 4 (capped) and
    # 4 (capped) KV splits; with 1, capping to 4 would leave some splits empty unless recounted.
    "splits": (16, [0, 5, 33, 100, 129]),
    "capped": (1, [4, 5, 8, 2]),
}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("case", EXTEND_CASES)
def test_extend_matches_reference(device, dtype, head_dim, case):
    batch = make_batch(*EXTEND_CASES[case], head_dim, dtype, device)
    out = run(triton_backend(head_dim, device), batch)
    assert_close(out, reference_attention(batch), dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_matches_reference(device, dtype, head_dim, case):
    min_kv_split_len, prefix_lens = DECODE_CASES[case]
    batch = make_batch(
        ForwardMode.DECODE, prefix_lens, [1] * len(prefix_lens), head_dim, dtype, device
    )
    out = run(triton_backend(head_dim, device, min_kv_split_len), batch)
    assert_close(out, reference_attention(batch), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_output_of_a_request_does_not_depend_on_its_batch_mates(device):
    prefix_lens = [100, 3, 57, 129]
    batch = make_batch(
        ForwardMode.DECODE, prefix_lens, [1] * len(prefix_lens), 32, torch.float32, device
    )
    together = run(triton_backend(32, device), batch)
    fb = batch.forward_batch
    for i, prefix_len in enumerate(prefix_lens):
        alone = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=fb.input_ids[i : i + 1],
            positions=fb.positions[i : i + 1],
            req_pool_indices=fb.req_pool_indices[i : i + 1],
            seq_lens=fb.seq_lens[i : i + 1],
            prefix_lens=fb.prefix_lens[i : i + 1],
            extend_lens=fb.extend_lens[i : i + 1],
            out_cache_loc=fb.out_cache_loc[i : i + 1],
            seq_lens_cpu=fb.seq_lens_cpu[i : i + 1],
            prefix_lens_cpu=[prefix_len],
            extend_lens_cpu=[1],
            req_to_token_pool=fb.req_to_token_pool,
            token_to_kv_pool=fb.token_to_kv_pool,
        )
        one = Batch(alone, batch.q[i : i + 1], batch.k[i : i + 1], batch.v[i : i + 1], batch.layer)
        assert torch.equal(run(triton_backend(32, device), one), together[i : i + 1])


@pytest.mark.parametrize("max_kv_splits", [1, 4, 8])
@pytest.mark.parametrize("min_kv_split_len", [1, 2, 16, 64])
def test_decode_kv_splits_are_never_empty_and_never_above_the_cap(max_kv_splits, min_kv_split_len):
    seq_lens = torch.arange(1, 600)
    splits = get_num_kv_splits(seq_lens, max_kv_splits, min_kv_split_len).long()
    split_len = (seq_lens + splits - 1) // splits
    assert splits.min() >= 1 and splits.max() <= max_kv_splits
    assert ((splits - 1) * split_len < seq_lens).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "mode,prefix_lens,extend_lens",
    [
        *EXTEND_CASES.values(),
        (ForwardMode.DECODE, DECODE_CASES["splits"][1], [1] * len(DECODE_CASES["splits"][1])),
    ],
    ids=[*EXTEND_CASES, "decode"],
)
def test_matches_torch_backend(device, mode, prefix_lens, extend_lens):
    batch = make_batch(mode, prefix_lens, extend_lens, 32, torch.float32, device)
    torch_backend = TorchAttnBackend(
        num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=32, device=device
    )
    assert_close(run(triton_backend(32, device), batch), run(torch_backend, batch), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_graph_decode_reads_static_buffers_and_padding_rows_leave_real_rows_unchanged(device):
    """The captured path: metadata from device ops only, into the buffers preallocated for
    the largest batch, over a batch padded as the GraphRunner pads (row 0, slot 0)."""
    prefix_lens = DECODE_CASES["splits"][1]
    batch = make_batch(
        ForwardMode.DECODE, prefix_lens, [1] * len(prefix_lens), 32, torch.float32, device
    )
    eager = run(triton_backend(32, device), batch)
    fb, pad = batch.forward_batch, 3
    padded = dataclasses.replace(
        fb,
        req_pool_indices=F.pad(fb.req_pool_indices, (0, pad), value=0),
        seq_lens=F.pad(fb.seq_lens, (0, pad), value=1),
        out_cache_loc=F.pad(fb.out_cache_loc, (0, pad), value=0),
    )
    q = F.pad(batch.q, (0, 0, 0, 0, 0, pad))
    k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (batch.k, batch.v))
    backend = triton_backend(32, device)
    backend.init_cuda_graph_state(16, fb.req_to_token_pool.max_context_len)
    with GraphSafetyMode():
        backend.init_forward_metadata_graph(padded)
    md, static = backend.forward_metadata, backend.graph_metadata
    assert isinstance(md, DecodeMetadata)
    for name in ("num_kv_splits", "attn_logits", "attn_lse"):
        assert getattr(md, name).data_ptr() == getattr(static, name).data_ptr(), name
    out = backend.forward(q, k, v, batch.layer, padded)
    assert torch.equal(out[: len(prefix_lens)], eager)
