"""How far each weight format and activation mode moves the embedded model's predictions,
measured the way llama.cpp checks its own quantizations: per-token log-probabilities of
held text against a float32 reference, reported as the mean |delta logprob| of the text's
tokens and the top-1 agreement (the same most likely next token).

The text is fed one token per decode step (teacher forcing), so the decode path's matmuls
(where `--quantized-activations` applies) produce every prediction. The reference is
the float32 model with the GGUF dequantized at load: the weights as shipped, without the
format's kernels. Results: docs/benchmarks/quantization.md.

    flock /tmp/radixserve-bench.lock .venv/bin/python -m benchmarks.quant_accuracy
    .venv/bin/python -m benchmarks.quant_accuracy --model gemma3-270m --configs 1 2 5
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from engine.kernels.cpu.isa import cpu_isa
from engine.model.embedded import EMBEDDED_MODEL, GEMMA3_MODEL
from engine.model.runner import ModelRunner
from engine.model.tokenizer_cache import load_tokenizer
from testing.batches import ExtendInput, build_forward_batch

HELD_TEXT = Path(__file__).with_name("data") / "held_text.txt"
CONFIGS = [
    ("float32", "none", "float", "float16"),
    ("float32", "gguf", "float", "float32"),
    ("float32", "gguf", "int16", "float32"),
    ("float32", "gguf", "int16", "float16"),
    ("float32", "gguf", "int8", "float32"),
    ("bfloat16", "gguf", "int16", "bfloat16"),
    ("bfloat16", "gguf", "int8", "bfloat16"),
    ("float32", "int8", "float", "float32"),
    ("float32", "int8", "int16", "float32"),
    ("float32", "int8", "int8", "float32"),
    ("bfloat16", "none", "int8", "bfloat16"),
]
"""(dtype, quantization, activations, KV cache dtype) against float32 with quantization
none and a float32 KV cache. float32 over the GGUF with int16 activations and a float16
cache is what `auto` picks on AVX2."""


def teacher_forced_logprobs(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """[len - 1, vocab] float64 log-probabilities of each next token, one decode step each."""
    (row,) = runner.req_to_token_pool.alloc(1)
    out = []
    for position, token in enumerate(tokens[:-1]):
        batch = build_forward_batch(runner, [ExtendInput(row, position, [token])])
        out.append(torch.log_softmax(runner.forward(batch)[0].double(), dim=-1))
    return torch.stack(out)


def runner_for(
    model: str,
    dtype: str,
    quantization: str,
    activations: str,
    kv_cache_dtype: str,
    context: int,
) -> ModelRunner:
    return ModelRunner(
        model,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_total_tokens=context + 16,
        # The batches built here free no slot a sliding window has passed (the scheduler
        # does): a hybrid model's sliding layers must hold the whole text too.
        swa_full_tokens_ratio=1.0,
        max_running_requests=2,
        quantization=quantization,
        quantized_activations=activations,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the held text fed")
    parser.add_argument("--model", choices=(EMBEDDED_MODEL, GEMMA3_MODEL), default=EMBEDDED_MODEL)
    parser.add_argument(
        "--configs",
        type=int,
        nargs="+",
        default=None,
        metavar="I",
        help="run only these rows of CONFIGS (0-based; default: all)",
    )
    args = parser.parse_args()
    tokens = load_tokenizer(args.model).encode(HELD_TEXT.read_text())[: args.tokens]
    targets = torch.tensor(tokens[1:])
    reference = teacher_forced_logprobs(
        runner_for(args.model, "float32", "none", "float", "float32", len(tokens)), tokens
    )
    isa = cpu_isa()
    print(f"kernel path {isa.path}; CPU flags {' '.join(isa.flags)}; load {os.getloadavg()}")
    print(
        f"{args.model}: {len(tokens)} tokens of {HELD_TEXT.name}; reference: float32, GGUF "
        "dequantized at load"
    )
    print(
        "| dtype | weights | decode activations | KV cache | mean abs delta logprob "
        "| top-1 agreement |"
    )
    print("|---|---|---|---|---|---|")
    rows = CONFIGS if args.configs is None else [CONFIGS[i] for i in args.configs]
    for dtype, quantization, activations, kv_cache_dtype in rows:
        runner = runner_for(
            args.model, dtype, quantization, activations, kv_cache_dtype, len(tokens)
        )
        logprobs = teacher_forced_logprobs(runner, tokens)
        picked = (logprobs - reference).gather(1, targets[:, None]).abs().mean().item()
        agree = (logprobs.argmax(-1) == reference.argmax(-1)).double().mean().item()
        act = activations if quantization != "none" else "-"
        print(
            f"| {dtype} | {runner.weights_format} | {act} | {kv_cache_dtype} | {picked:.4f} "
            f"| {agree:.1%} |"
        )


if __name__ == "__main__":
    main()
