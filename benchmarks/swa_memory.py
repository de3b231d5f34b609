"""What two KV pools save a hybrid sliding-window model in steady decode: one request decodes
to `--context` tokens on a random-weight Gemma 3 with Gemma 3 270M's attention (18 layers,
every sixth global, a window of 512, one KV head of 256; a narrow hidden size and vocabulary
make each step cheap, and change no KV byte), and the peak slots it holds in each pool give
its KV bytes, against every layer holding every token. The number of such requests a KV
budget holds follows from the pools the runner sized for that budget.

    .venv/bin/python -m benchmarks.swa_memory --context 8192 --ratio 0.07
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from engine.api import Engine
from engine.mem.kv_pool import MHATokenToKVPool
from engine.mem.swa_allocator import SWATokenToKVPoolAllocator

LAYERS, PATTERN, WINDOW = 18, 6, 512


def save_model(path: str, context: int) -> None:
    layer_types = [
        "full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(LAYERS)
    ]
    config = Gemma3TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=WINDOW,
        layer_types=layer_types,
        max_position_embeddings=context + 64,
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--ratio", type=float, default=0.07, help="--swa-full-tokens-ratio")
    parser.add_argument("--prompt", type=int, default=16)
    args = parser.parse_args()
    budget = 4 * args.context  # all-full slots: four requests' worth
    path = tempfile.mkdtemp(prefix="swa-memory-")
    save_model(path, args.context)
    options = dict(
        dtype="bfloat16",
        device="cpu",
        skip_tokenizer_init=True,
        max_total_tokens=budget,
        swa_full_tokens_ratio=args.ratio,
    )
    with Engine(path, **options) as engine:
        runner = engine.scheduler.model_runner
        allocator = runner.token_to_kv_pool_allocator
        assert isinstance(allocator, SWATokenToKVPoolAllocator)
        peak = [0, 0]
        process = engine.scheduler.process_batch_result

        def recorded(*a: object) -> None:
            process(*a)
            peak[0] = max(peak[0], allocator.size - allocator.full_available_size())
            peak[1] = max(peak[1], allocator.size_swa - allocator.swa_available_size())

        engine.scheduler.process_batch_result = recorded  # type: ignore[method-assign]
        started = time.perf_counter()
        new_tokens = args.context - args.prompt
        engine.generate(
            [list(range(3, 3 + args.prompt))],
            {"temperature": 0, "ignore_eos": True, "max_new_tokens": new_tokens},
        )
        seconds = time.perf_counter() - started
        swa_layers = sum(runner.swa_layers or ())
        cell = MHATokenToKVPool.cell_size(1, 256, 1, runner.kv_cache_dtype)
        full_size, swa_size = allocator.size, allocator.size_swa
    full_layers = LAYERS - swa_layers
    held = (peak[0] * full_layers + peak[1] * swa_layers) * cell
    all_full = args.context * LAYERS * cell
    hybrid_count = min(full_size // peak[0], swa_size // peak[1])
    print(f"one request decoding to {args.context} tokens ({seconds:.0f} s)")
    print(
        f"peak slots held: full pool {peak[0]}, SWA pool {peak[1]} "
        f"({full_layers} full layers, {swa_layers} sliding, {cell} B per slot per layer)"
    )
    print(
        f"KV bytes per request: {held / 2**20:.1f} MiB against {all_full / 2**20:.1f} MiB "
        f"with every layer holding every token: {held / all_full:.3f}x"
    )
    print(
        f"budget of {budget} all-layer slots, --swa-full-tokens-ratio {args.ratio}: pools of "
        f"{full_size} full and {swa_size} SWA slots hold {hybrid_count} such requests, "
        f"one pool {budget // args.context}: {hybrid_count / (budget // args.context):.2f}x"
    )


if __name__ == "__main__":
    main()
