"""Attention backend micro-benchmark on CUDA: Triton kernels against the torch (SDPA) backend.

Times one layer's attention for a decode step at several batch sizes and for a prefill,
at the embedded model's attention shape (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64),
with each request's KV slots scattered over the pool as a long-running server leaves them.
Also prints the largest difference between the two backends' outputs.

Run (GPU only): .venv/bin/python benchmarks/attention_bench.py [--context 1024] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch

from engine.mem.kv_pool import MHATokenToKVPool
from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.model.attention.base import AttentionBackend, AttentionLayer
from engine.model.attention.torch_backend import TorchAttnBackend
from engine.model.attention.triton_backend import TritonAttnBackend
from engine.model.forward_batch import ForwardBatch, ForwardMode

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64


QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def make_batch(
    batch_size: int, prefix_len: int, extend_len: int, dtype: torch.dtype
) -> tuple[ForwardBatch, QKV]:
    """`batch_size` requests of `prefix_len` cached + `extend_len` new tokens on random slots."""
    seq_len = prefix_len + extend_len
    pool_size = batch_size * seq_len
    kv_pool = MHATokenToKVPool(pool_size, dtype, NUM_KV_HEADS, HEAD_DIM, 1, "cuda")
    kv_pool.k_buffer[0].normal_()
    kv_pool.v_buffer[0].normal_()
    req_pool = ReqToTokenPool(batch_size, seq_len, "cuda")
    slots = (torch.randperm(pool_size, device="cuda") + 1).view(batch_size, seq_len)
    req_pool.req_to_token[1:] = slots.to(torch.int32)
    num_tokens = batch_size * extend_len
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE if extend_len == 1 else ForwardMode.EXTEND,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device="cuda"),
        positions=torch.arange(prefix_len, seq_len, device="cuda").repeat(batch_size),
        req_pool_indices=torch.arange(1, batch_size + 1, device="cuda"),
        seq_lens=torch.full((batch_size,), seq_len, device="cuda"),
        prefix_lens=torch.full((batch_size,), prefix_len, device="cuda"),
        extend_lens=torch.full((batch_size,), extend_len, device="cuda"),
        out_cache_loc=slots[:, prefix_len:].reshape(-1),
        seq_lens_cpu=[seq_len] * batch_size,
        prefix_lens_cpu=[prefix_len] * batch_size,
        extend_lens_cpu=[extend_len] * batch_size,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
    )
    q, k, v = (
        torch.randn(num_tokens, heads, HEAD_DIM, device="cuda", dtype=dtype)
        for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)
    )
    return fb, (q, k, v)


def time_layer(
    backend: AttentionBackend, fb: ForwardBatch, qkv: QKV, iters: int = 50
) -> tuple[float, torch.Tensor]:
    """Mean milliseconds of one layer's `forward` (metadata built once, as per batch)."""
    layer = AttentionLayer(0, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    backend.init_forward_metadata(fb)
    out = backend.forward(*qkv, layer, fb)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        backend.forward(*qkv, layer, fb)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--context", type=int, default=1024, help="cached tokens per decode request"
    )
    parser.add_argument("--prompt", type=int, default=512, help="prefill tokens per request")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(
        f"{torch.cuda.get_device_name()}  {args.dtype}  heads {NUM_HEADS}/{NUM_KV_HEADS}  "
        f"head_dim {HEAD_DIM}"
    )
    print(f"{'case':<28}{'triton ms':>11}{'torch ms':>11}{'max |diff|':>12}")
    shapes = [(f"decode b={b} ctx={args.context}", b, args.context, 1) for b in (1, 8, 32, 64)]
    shapes += [(f"prefill b={b} prompt={args.prompt}", b, 0, args.prompt) for b in (1, 8)]
    for name, batch_size, prefix_len, extend_len in shapes:
        fb, qkv = make_batch(batch_size, prefix_len, extend_len, dtype)
        kwargs = dict(
            num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, device="cuda"
        )
        triton_ms, triton_out = time_layer(TritonAttnBackend(**kwargs), fb, qkv)
        torch_ms, torch_out = time_layer(TorchAttnBackend(**kwargs), fb, qkv)
        diff = (triton_out.float() - torch_out.float()).abs().max().item()
        print(f"{name:<28}{triton_ms:>11.3f}{torch_ms:>11.3f}{diff:>12.2e}")


if __name__ == "__main__":
    main()
