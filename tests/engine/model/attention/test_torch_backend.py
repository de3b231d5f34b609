"""The torch backend against softmax(QK^T)V written out per request, in float64; its
decode both through the C++ kernel and through torch ops, and its bf16 prefill through the
AMX kernel where the CPU has AMX."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.mem.kv_pool import MHATokenToKVPool
from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.model.attention import create_attention_backend
from engine.model.attention.base import AttentionLayer
from engine.model.attention.torch_backend import TorchAttnBackend
from engine.model.forward_batch import ForwardBatch, ForwardMode

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
LAYER = AttentionLayer(
    layer_id=1, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, scaling=0.3
)


def make_batch(
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    layer: AttentionLayer = LAYER,
    kv_dtype: torch.dtype | None = None,
):
    """Requests on scattered slots of a pool full of random K/V (of `kv_dtype`, default
    `dtype`). Prefix slots are in `req_to_token`; the new tokens' entries hold stale slots,
    as before the scheduler writes them."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool_size = sum(seq_lens) + 11
    kv_pool = MHATokenToKVPool(
        pool_size, kv_dtype or dtype, layer.num_kv_heads, layer.head_dim, 2, "cpu"
    )
    for buffer in kv_pool.get_kv_buffer(layer.layer_id):
        buffer.copy_(torch.randn(buffer.shape, generator=gen, dtype=torch.float64))
    req_pool = ReqToTokenPool(len(seq_lens) + 2, max(seq_lens) + 3, "cpu")
    req_pool.req_to_token.copy_(
        torch.randint(1, pool_size + 1, req_pool.req_to_token.shape, generator=gen)
    )
    slots = torch.randperm(pool_size, generator=gen)[: sum(seq_lens)] + 1
    rows = (torch.randperm(req_pool.size, generator=gen)[: len(seq_lens)] + 1).tolist()
    out_cache_loc, start = [], 0
    for row, prefix_len, seq_len in zip(rows, prefix_lens, seq_lens):
        req_pool.write(row, 0, slots[start : start + prefix_len])
        out_cache_loc.append(slots[start + prefix_len : start + seq_len])
        start += seq_len
    num_tokens = sum(extend_lens)
    fb = ForwardBatch(
        forward_mode=mode,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens)]),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        prefix_lens=torch.tensor(prefix_lens),
        extend_lens=torch.tensor(extend_lens),
        out_cache_loc=torch.cat(out_cache_loc),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=prefix_lens,
        extend_lens_cpu=extend_lens,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
    )
    q, k, v = (
        torch.randn(num_tokens, h, layer.head_dim, generator=gen, dtype=torch.float64).to(dtype)
        for h in (layer.num_heads, layer.num_kv_heads, layer.num_kv_heads)
    )
    return fb, q, k, v


def reference_attention(
    fb: ForwardBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: AttentionLayer = LAYER,
) -> torch.Tensor:
    """Each request's queries over its whole prefix and new tokens, masked to the causal
    (and, for a layer with `sliding_window`, windowed) keys of each position."""
    k_buffer, v_buffer = (b.double() for b in fb.token_to_kv_pool.get_kv_buffer(layer.layer_id))
    stored = fb.token_to_kv_pool.dtype  # the new K/V as the pool keeps them
    q, k, v = q.double(), k.to(stored).double(), v.to(stored).double()
    group = layer.num_heads // layer.num_kv_heads
    outputs, start = [], 0
    for row, prefix_len, extend_len in zip(
        fb.req_pool_indices.tolist(), fb.prefix_lens_cpu, fb.extend_lens_cpu
    ):
        new = slice(start, start + extend_len)
        prefix_slots = fb.req_to_token_pool.req_to_token[row, :prefix_len].long()
        keys = torch.cat([k_buffer[prefix_slots], k[new]]).repeat_interleave(group, 1)
        values = torch.cat([v_buffer[prefix_slots], v[new]]).repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[new], keys) * layer.scaling
        key_positions = torch.arange(prefix_len + extend_len)[None, :]
        positions = torch.arange(prefix_len, prefix_len + extend_len)[:, None]
        visible = key_positions <= positions
        if layer.sliding_window is not None:  # (p - window, p]
            visible &= key_positions > positions - layer.sliding_window
        outputs.append(
            torch.einsum(
                "hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values
            )
        )
        start += extend_len
    return torch.cat(outputs)


def run(
    fb: ForwardBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cpu_kernel: bool = True,
    layer: AttentionLayer = LAYER,
) -> torch.Tensor:
    backend = TorchAttnBackend(
        num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_dim,
        device="cpu",
        cpu_kernel=cpu_kernel,
    )
    assert backend.cpu_kernel == cpu_kernel
    backend.init_forward_metadata(fb)
    return backend.forward(q, k, v, layer, fb)


CASES = {
    # (mode, prefix_lens, extend_lens)
    "extend_ragged_with_prefixes": (
        ForwardMode.EXTEND,
        [0, 45, 70, 0, 13, 0],
        [37, 1, 20, 1, 66, 2],
    ),
    "extend_one_token_prompts": (ForwardMode.EXTEND, [0, 0, 0], [1, 1, 1]),
    "mixed": (ForwardMode.MIXED, [0, 20, 7, 50], [30, 12, 1, 1]),
    "decode": (ForwardMode.DECODE, [0, 5, 33, 100, 129], [1, 1, 1, 1, 1]),
}


def test_the_cpu_kernel_builds_here():
    """The suite's machines have a compiler: the kernel tests below must not fall back."""
    assert cpu_build.available()


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["kernel", "torch-ops"])
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_the_reference(case, cpu_kernel):
    fb, q, k, v = make_batch(*CASES[case])
    torch.testing.assert_close(
        run(fb, q, k, v, cpu_kernel), reference_attention(fb, q, k, v), atol=1e-12, rtol=1e-12
    )


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["kernel", "torch-ops"])
@pytest.mark.parametrize("case", CASES)
def test_float32_attention_over_a_float16_pool_reads_the_halves_as_stored(case, cpu_kernel):
    """`--kv-cache-dtype float16` under float32: the output is float32, and equals float64
    attention over the pool's halves (the new K/V rounded to half as they are written)."""
    fb, q, k, v = make_batch(*CASES[case], dtype=torch.float32, kv_dtype=torch.float16)
    out = run(fb, q, k, v, cpu_kernel)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference_attention(fb, q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)]
)
def test_decode_kernel_in_half_and_single_precision_is_close_to_float64(dtype, tolerance):
    """It accumulates in float32, so it is at least as close as the torch ops' rounding."""
    fb, q, k, v = make_batch(ForwardMode.DECODE, [0, 5, 33, 100, 129], [1] * 5, dtype=dtype)
    expected = reference_attention(fb, q, k, v)
    kernel = run(fb, q, k, v, cpu_kernel=True).double()
    torch_ops = run(fb, q, k, v, cpu_kernel=False).double()
    kernel_error = (kernel - expected).abs().max().item()
    assert kernel_error <= tolerance
    assert kernel_error <= (torch_ops - expected).abs().max().item() * 1.01 + 1e-7


KERNEL_LAYOUTS = {
    # (query heads, KV heads, head_dim): which of the kernel's paths a layout takes
    "group3_dim64": (9, 3, 64),  # SmolLM2's: blocked scores, value sums in registers
    "group5_dim128": (10, 2, 128),  # query heads in register tiles of 4, then 1
    "mha_dim64": (4, 4, 64),
    "group2_dim32": (8, 4, 32),
    "group2_dim48": (4, 2, 48),  # blocked scores, value sums on the plain loop
    "group2_dim8": (4, 2, 8),  # the plain loops only
}
KERNEL_LENS = [1, 15, 16, 17, 40, 100]
"""Shorter than a 16-key block, one block, blocks with a tail."""


@pytest.mark.parametrize("num_reqs", [len(KERNEL_LENS), 1], ids=["batch", "one-request"])
@pytest.mark.parametrize("layout", list(KERNEL_LAYOUTS))
@pytest.mark.parametrize(
    "dtype, kv_dtype, tolerance",
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.bfloat16, torch.bfloat16, 2e-2),
        (torch.float16, torch.float16, 2e-3),
        (torch.float32, torch.float16, 1e-5),  # a 16-bit pool widened under float queries
        (torch.float32, torch.bfloat16, 1e-5),
    ],
)
def test_decode_kernel_layouts_match_float64(layout, dtype, kv_dtype, tolerance, num_reqs):
    """The kernel alone, on head layouts and lengths that take each of its paths, against
    softmax(qK^T)V in float64 over the same (rounded) inputs; slots past a length are
    garbage."""
    heads, kv_heads, head_dim = KERNEL_LAYOUTS[layout]
    gen = torch.Generator().manual_seed(7)
    lens = KERNEL_LENS[-num_reqs:]
    pool = sum(lens) + 5
    k_buffer, v_buffer = (
        torch.randn(pool, kv_heads, head_dim, generator=gen).to(kv_dtype) for _ in range(2)
    )
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    slots = torch.randint(0, pool, (len(lens), max(lens) + 3), generator=gen)
    order, start = torch.randperm(pool, generator=gen), 0
    for r, n in enumerate(lens):
        slots[r, :n] = order[start : start + n]
        start += n
    out = cpu_ops.decode_attention(q, k_buffer, v_buffer, slots, torch.tensor(lens), LAYER.scaling)
    group = heads // kv_heads
    for r, n in enumerate(lens):
        keys, values = (
            b.double()[slots[r, :n]].repeat_interleave(group, 1) for b in (k_buffer, v_buffer)
        )
        scores = torch.einsum("hd,khd->hk", q[r].double(), keys) * LAYER.scaling
        expected = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
        torch.testing.assert_close(out[r].double(), expected, rtol=0, atol=tolerance)


amx = pytest.mark.skipif(
    not cpu_ops.extend_attention_available(), reason="this CPU (or kernel build) has no AMX"
)
EXTEND_LAYOUTS = {
    "group3_dim64": (9, 3, 64),
    "group5_dim128": (10, 2, 128),
    "mha_dim64": (4, 4, 64),
}


def sdpa_bf16(q, keys, values, prefix_len, scaling):
    """What the torch path computes for one request in bf16: SDPA with the prefix-causal mask."""
    visible = (
        torch.arange(keys.shape[0])[None, :]
        <= torch.arange(prefix_len, prefix_len + q.shape[0])[:, None]
    )
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=visible,
        scale=scaling,
        enable_gqa=True,
    )[0].transpose(0, 1)


@amx
@pytest.mark.parametrize("layout", list(EXTEND_LAYOUTS))
def test_extend_kernel_matches_float64_and_sdpa(layout):
    """The AMX kernel alone: new tokens around the 16-row blocks and prefixes around the
    64-key bands, queries as strided rows of a wider projection output, starting past rows
    of no request (left zero); against softmax(QK^T)V in float64 over the same bf16 inputs,
    and no further from it than SDPA in bf16 (plus one bf16 unit)."""
    heads, kv_heads, head_dim = EXTEND_LAYOUTS[layout]
    gen = torch.Generator().manual_seed(3)
    prefix_lens, extend_lens = [0, 5, 64, 200, 0, 17], [2, 15, 16, 17, 70, 33]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = sum(seq_lens) + 7
    k_buffer, v_buffer = (
        torch.randn(pool, kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2)
    )
    rows = 3 + sum(extend_lens)  # rows 0-2 belong to no request
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=gen).bfloat16()
    q = qkv[:, :heads]
    slots = torch.randint(0, pool, (len(seq_lens), max(seq_lens) + 2), generator=gen)
    order, start = torch.randperm(pool, generator=gen), 0
    for r, n in enumerate(seq_lens):
        slots[r, :n] = order[start : start + n]
        start += n
    q_starts = [3 + sum(extend_lens[:r]) for r in range(len(seq_lens))]
    scaling = head_dim**-0.5
    out = cpu_ops.extend_attention(
        q,
        k_buffer,
        v_buffer,
        slots,
        torch.tensor(prefix_lens),
        torch.tensor(extend_lens),
        torch.tensor(q_starts),
        scaling,
    )
    assert out.shape == q.shape and not out[:3].any()
    group = heads // kv_heads
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        keys, values = (b[slots[r, : p + e]] for b in (k_buffer, v_buffer))
        queries = q[q_starts[r] : q_starts[r] + e]
        visible = torch.arange(p + e)[None, :] <= torch.arange(p, p + e)[:, None]
        scores = torch.einsum(
            "qhd,khd->hqk", queries.double(), keys.double().repeat_interleave(group, 1)
        )
        expected = torch.einsum(
            "hqk,khd->qhd",
            (scores * scaling).masked_fill(~visible, float("-inf")).softmax(-1),
            values.double().repeat_interleave(group, 1),
        )
        error = (out[q_starts[r] : q_starts[r] + e].double() - expected).abs()
        sdpa_error = (sdpa_bf16(queries, keys, values, p, scaling).double() - expected).abs()
        assert error.max() <= 2e-2
        assert error.max() <= sdpa_error.max() + expected.abs().max() * 2.0**-8


@amx
def test_a_bf16_prefill_attends_through_the_extend_kernel(monkeypatch):
    """head_dim 64 on a bf16 pool: the batch's multi-token requests go through one kernel
    call, its one-token riders through the decode group, and the whole matches float64."""
    layer = AttentionLayer(layer_id=1, num_heads=9, num_kv_heads=3, head_dim=64, scaling=0.125)
    fb, q, k, v = make_batch(
        ForwardMode.MIXED, [0, 20, 7, 50], [30, 12, 1, 1], dtype=torch.bfloat16, layer=layer
    )
    calls, kernel = [], cpu_ops.extend_attention
    monkeypatch.setattr(
        cpu_ops, "extend_attention", lambda *a: calls.append(a[3].shape) or kernel(*a)
    )
    out = run(fb, q, k, v, layer=layer).double()
    assert calls == [(2, 32)]  # the two multi-token requests: 30 and 20 + 12 slots
    torch.testing.assert_close(out, reference_attention(fb, q, k, v, layer), rtol=0, atol=2e-2)


def test_new_kv_lands_in_the_pool_at_out_cache_loc():
    fb, q, k, v = make_batch(*CASES["mixed"])
    run(fb, q, k, v)
    assert torch.equal(fb.token_to_kv_pool.k_buffer[LAYER.layer_id][fb.out_cache_loc], k)
    assert torch.equal(fb.token_to_kv_pool.v_buffer[LAYER.layer_id][fb.out_cache_loc], v)


def test_decode_output_of_a_request_does_not_depend_on_its_batch_mates():
    prefix_lens = [100, 3, 57, 129]
    fb, q, k, v = make_batch(ForwardMode.DECODE, prefix_lens, [1] * len(prefix_lens))
    together = run(fb, q, k, v)
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
            seq_lens_cpu=[prefix_len + 1],
            prefix_lens_cpu=[prefix_len],
            extend_lens_cpu=[1],
            req_to_token_pool=fb.req_to_token_pool,
            token_to_kv_pool=fb.token_to_kv_pool,
        )
        torch.testing.assert_close(
            run(alone, q[i : i + 1], k[i : i + 1], v[i : i + 1]),
            together[i : i + 1],
            atol=1e-14,
            rtol=0,
        )


def test_decode_kernel_reads_only_up_to_each_length_and_is_deterministic():
    """Stale slots past a request's length (NaN here) never reach its output."""
    fb, q, k, v = make_batch(ForwardMode.DECODE, [4, 60], [1, 1])
    group = TorchAttnBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, "cpu")
    group.init_forward_metadata(fb)
    expected = group.forward(q, k, v, LAYER, fb)
    k_buffer, v_buffer = fb.token_to_kv_pool.get_kv_buffer(LAYER.layer_id)
    used = torch.cat(
        [
            fb.req_to_token_pool.req_to_token[r, :n].long()
            for r, n in zip(fb.req_pool_indices.tolist(), fb.prefix_lens_cpu)
        ]
        + [fb.out_cache_loc]
    )
    unused = torch.ones(k_buffer.shape[0], dtype=torch.bool)
    unused[used] = False
    unused[0] = False
    k_buffer[unused] = float("nan")
    v_buffer[unused] = float("nan")
    assert torch.equal(group.forward(q, k, v, LAYER, fb), expected)


def test_factory_builds_the_torch_backend_and_rejects_unknown_names():
    backend = create_attention_backend(
        "torch", num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, device="cpu"
    )
    assert isinstance(backend, TorchAttnBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        create_attention_backend(
            "flash", num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, device="cpu"
        )


def test_without_a_compiler_decode_stays_on_torch_ops(tmp_path):
    """A machine that cannot build the kernels (the CPU image has no compiler) logs why and
    serves decode through torch ops; the cache keeps nothing half-built."""
    probe = (
        "from engine.model.attention.torch_backend import TorchAttnBackend\n"
        "print(TorchAttnBackend(6, 2, 16, 'cpu').cpu_kernel)\n"
    )
    env = {**os.environ, "RADIXSERVE_CACHE_DIR": str(tmp_path), "CXX": "/nonexistent/c++"}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["False"]
    assert "CPU kernels unavailable, using torch ops" in done.stderr
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.o"))


GUARDED_SWEEP = """
import threading, torch
from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
assert cpu_build.available()
torch.set_num_threads(1)  # the kernel runs on the calling thread, its scratch on its heap
gen = torch.Generator().manual_seed(0)
k_buffer, v_buffer = (torch.randn(4097, 1, 16, generator=gen) for _ in range(2))
slots = torch.randint(1, 4097, (1, 6000), generator=gen)
release = threading.Event()
def sweep(heads, swept):
    try:
        q = torch.randn(1, heads, 16, generator=gen)
        for n in range(1, slots.shape[1]):
            out = cpu_ops.decode_attention(
                q, k_buffer, v_buffer, slots[:, :n], torch.tensor([n]), 1.0
            )
            assert out.isfinite().all()
        print(heads, flush=True)
    finally:
        swept.set()
    release.wait()  # alive, so that the next thread gets a heap of its own
threads = []
for heads in (3, 5, 7):
    swept = threading.Event()
    threads.append(threading.Thread(target=sweep, args=(heads, swept)))
    threads[-1].start()
    swept.wait()
release.set()
for thread in threads:
    thread.join()
"""


def test_decode_kernel_reads_no_score_past_the_last_key():
    """The softmax's max read the scores in whole blocks of 16, past the last key and past
    the end of its scratch buffer: a worker segfaulted where a thread's heap ended right
    after that buffer. Without glibc's top pad a thread's heap ends at the page after its
    highest allocation, so each growth of the scores puts their end at the heap's end: a
    sweep of lengths for 3, 5 and 7 query heads per KV head (each thread on a heap of its
    own) meets an over-read that crosses it: before the fix it crashed whichever offset of
    a page (86 tried, 48 bytes apart) an allocation in front had moved the heap to."""
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.top_pad=0"}
    done = subprocess.run(
        [sys.executable, "-c", GUARDED_SWEEP], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.split() == ["3", "5", "7"], done.stderr[-2000:]
