"""Model-runtime speed on the embedded SmolLM2-135M: radixserve's ModelRunner beside
transformers' forward on the same weights, same dtype, same shapes, in one run.

Prefill: one 512-token prompt, tokens/s. Decode: one step for a batch of requests that
each hold `--decode-context` tokens of KV, ms/step (median of `--steps`). Random token ids:
speed does not depend on them. Results: docs/benchmarks/model.md.

    .venv/bin/python benchmarks/model_bench.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, PreTrainedModel

from engine.model.loader import open_checkpoint
from engine.model.runner import DTYPES, ExtendInput, ModelRunner


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_model(dtype: torch.dtype) -> PreTrainedModel:
    """transformers' Llama with the weights our loader reads from the embedded GGUF."""
    checkpoint = open_checkpoint("embedded")
    c = checkpoint.config
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.context_len,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_word_embeddings,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.load_state_dict(dict(checkpoint.weights()), strict=False)
    model.tie_weights()
    return model


def bench_ours(dtype: str, args: argparse.Namespace) -> dict[str, float]:
    runner = ModelRunner(
        "embedded",
        dtype=dtype,
        max_total_tokens=max(args.batch_sizes) * (args.decode_context + args.steps + 2)
        + args.prompt_len * 2,
        max_running_requests=max(args.batch_sizes) + 1,
    )
    vocab = runner.model_config.vocab_size
    results = {}
    row = runner.req_to_token_pool.alloc(1)[0]
    prompt = torch.randint(vocab, (args.prompt_len,)).tolist()

    def prefill() -> None:
        fb = runner.build_forward_batch([ExtendInput(row, 0, prompt)])
        runner.forward(fb)
        runner.token_to_kv_pool_allocator.free(fb.out_cache_loc)

    results["prefill"] = args.prompt_len / median_seconds(prefill, args.steps)
    runner.req_to_token_pool.free(row)

    for batch_size in args.batch_sizes:
        rows = runner.req_to_token_pool.alloc(batch_size)
        contexts = torch.randint(vocab, (batch_size, args.decode_context)).tolist()
        for start in range(0, batch_size, 8):
            runner.forward(
                runner.build_forward_batch(
                    [
                        ExtendInput(r, 0, ctx)
                        for r, ctx in zip(rows[start : start + 8], contexts[start : start + 8])
                    ]
                )
            )
        seq_len = args.decode_context

        def decode(rows: list[int] = rows) -> None:  # bound now: the loop rebinds `rows`
            nonlocal seq_len
            runner.forward(runner.build_forward_batch([ExtendInput(r, seq_len, [7]) for r in rows]))
            seq_len += 1

        results[f"decode_{batch_size}"] = median_seconds(decode, args.steps) * 1000
        for r in rows:
            runner.token_to_kv_pool_allocator.free(
                runner.req_to_token_pool.req_to_token[r, :seq_len].long()
            )
        runner.req_to_token_pool.free(rows)
    return results


def bench_hf(dtype: str, args: argparse.Namespace) -> dict[str, float]:
    model = hf_model(DTYPES[dtype])
    vocab = model.config.vocab_size
    results = {}
    prompt = torch.randint(vocab, (1, args.prompt_len))
    with torch.inference_mode():
        results["prefill"] = args.prompt_len / median_seconds(
            lambda: model(prompt, use_cache=True), args.steps
        )
        for batch_size in args.batch_sizes:
            cache = DynamicCache(config=model.config)
            model(
                torch.randint(vocab, (batch_size, args.decode_context)), cache=cache, use_cache=True
            )
            next_ids = torch.full((batch_size, 1), 7)
            results[f"decode_{batch_size}"] = (
                median_seconds(partial(model, next_ids, cache=cache, use_cache=True), args.steps)
                * 1000
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-context", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    decode_cols = [f"decode b={b} (ms/step)" for b in args.batch_sizes]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"decode context {args.decode_context} tokens/request\n"
    )
    print(
        f"| engine | dtype | prefill {args.prompt_len} (tok/s) | " + " | ".join(decode_cols) + " |"
    )
    print("|---|---|---:|" + "---:|" * len(decode_cols))
    for dtype in args.dtypes:
        for name, bench in (("radixserve", bench_ours), ("transformers", bench_hf)):
            r = bench(dtype, args)
            decode = " | ".join(f"{r[f'decode_{b}']:.1f}" for b in args.batch_sizes)
            print(f"| {name} | {dtype} | {r['prefill']:.0f} | {decode} |", flush=True)


if __name__ == "__main__":
    main()
