"""Attention backend micro-benchmark: on CUDA, Triton kernels against the torch backend; on
CPU, the torch backend's decode through its C++ kernel against its torch ops.

Times one layer's attention for a decode step at several batch sizes (and, on CUDA, for a
prefill), at the embedded model's attention shape (SmolLM2-135M: 9 query heads, 3 KV heads,
head_dim 64), with each request's KV slots scattered over the pool as a long-running server
leaves them. Also prints the largest difference between the two outputs.

Run: .venv/bin/python -m benchmarks.attention_bench [--context 1024] [--dtype bfloat16]
     .venv/bin/python -m benchmarks.attention_bench --device cpu --context 512
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

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
    batch_size: int, prefix_len: int, extend_len: int, dtype: torch.dtype, device: str = "cuda"
) -> tuple[ForwardBatch, QKV]:
    """`batch_size` requests of `prefix_len` cached + `extend_len` new tokens on random slots."""
    seq_len = prefix_len + extend_len
    pool_size = batch_size * seq_len
    kv_pool = MHATokenToKVPool(pool_size, dtype, NUM_KV_HEADS, HEAD_DIM, 1, device)
    kv_pool.k_buffer[0].normal_()
    kv_pool.v_buffer[0].normal_()
    req_pool = ReqToTokenPool(batch_size, seq_len, device)
    slots = (torch.randperm(pool_size, device=device) + 1).view(batch_size, seq_len)
    req_pool.req_to_token[1:] = slots.to(torch.int32)
    num_tokens = batch_size * extend_len
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE if extend_len == 1 else ForwardMode.EXTEND,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.arange(prefix_len, seq_len, device=device).repeat(batch_size),
        req_pool_indices=torch.arange(1, batch_size + 1, device=device),
        seq_lens=torch.full((batch_size,), seq_len, device=device),
        prefix_lens=torch.full((batch_size,), prefix_len, device=device),
        extend_lens=torch.full((batch_size,), extend_len, device=device),
        out_cache_loc=slots[:, prefix_len:].reshape(-1),
        seq_lens_cpu=[seq_len] * batch_size,
        prefix_lens_cpu=[prefix_len] * batch_size,
        extend_lens_cpu=[extend_len] * batch_size,
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
    )
    q, k, v = (
        torch.randn(num_tokens, heads, HEAD_DIM, device=device, dtype=dtype)
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


def best_ms(fn: Callable[[], torch.Tensor], iters: int, rounds: int = 5) -> float:
    """The best of `rounds` means over `iters` calls: the machine may be shared."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters * 1e3)
    return best


def time_cpu_decode(dtype: torch.dtype, batch_size: int, context: int) -> tuple[float, ...]:
    """(C++ kernel ms, torch ops ms, max |diff|) of one layer's decode attention on CPU."""
    layer = AttentionLayer(0, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    fb, (q, _, _) = make_batch(batch_size, context, 1, dtype, "cpu")
    backends = [
        TorchAttnBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, "cpu", cpu_kernel=kernel)
        for kernel in (True, False)
    ]
    assert backends[0].cpu_kernel, "the C++ kernel did not build: see the log"
    runs = []
    for backend in backends:
        backend.init_forward_metadata(fb)
        runs.append(lambda backend=backend: backend.forward_decode(q, layer, fb))
    iters = max(3, 200 // batch_size)
    diff = (runs[0]().float() - runs[1]().float()).abs().max().item()
    return best_ms(runs[0], iters), best_ms(runs[1], iters), diff


def time_cpu_prefill(
    dtype: torch.dtype, batch_size: int, prefix: int, new: int
) -> tuple[float, ...]:
    """(kernel ms, SDPA ms, max |diff|) of one layer's prefill attention on CPU: the AMX
    extend kernel where it applies (bf16 on a CPU with AMX), else the same SDPA twice."""
    layer = AttentionLayer(0, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    fb, (q, _, _) = make_batch(batch_size, prefix, new, dtype, "cpu")
    runs = []
    for kernel in (True, False):
        backend = TorchAttnBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, "cpu", cpu_kernel=kernel)
        backend.init_forward_metadata(fb)
        runs.append(lambda backend=backend: backend.forward_extend(q, layer, fb))
    diff = (runs[0]().float() - runs[1]().float()).abs().max().item()
    return best_ms(runs[0], 3), best_ms(runs[1], 3), diff


def main_cpu(args: argparse.Namespace) -> None:
    print(
        f"cpu  {torch.get_num_threads()} threads  heads {NUM_HEADS}/{NUM_KV_HEADS}  "
        f"head_dim {HEAD_DIM}; one layer's attention, best of 5 rounds"
    )
    print(f"{'case':<36}{'kernel ms':>11}{'torch ops ms':>14}{'max |diff|':>12}")
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for batch_size in args.batch_sizes:
            kernel, torch_ops, diff = time_cpu_decode(dtype, batch_size, args.context)
            name = f"{dtype_name} decode b={batch_size} ctx={args.context}"
            print(f"{name:<36}{kernel:>11.3f}{torch_ops:>14.3f}{diff:>12.2e}", flush=True)
        for batch_size, new, prefix in args.cpu_prefill:
            kernel, torch_ops, diff = time_cpu_prefill(dtype, batch_size, prefix, new)
            name = f"{dtype_name} prefill b={batch_size} {new} over {prefix}"
            print(f"{name:<36}{kernel:>11.3f}{torch_ops:>14.3f}{diff:>12.2e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--context", type=int, default=1024, help="cached tokens per decode request"
    )
    parser.add_argument("--prompt", type=int, default=512, help="prefill tokens per request")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["bfloat16"],
        choices=["bfloat16", "float16", "float32"],
        help="CUDA: the first; CPU: each in turn",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--cpu-prefill",
        type=lambda text: tuple(int(n) for n in text.replace("+", "x").split("x")),
        nargs="*",
        default=[(8, 96, 200), (1, 512, 0)],
        metavar="BxNEW+PREFIX",
        help="CPU: prefill shapes, batch x new tokens + cached prefix per request",
    )
    args = parser.parse_args()
    if args.device == "cpu":
        main_cpu(args)
        return
    dtype = getattr(torch, args.dtype[0])
    print(
        f"{torch.cuda.get_device_name()}  {args.dtype[0]}  heads {NUM_HEADS}/{NUM_KV_HEADS}  "
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
