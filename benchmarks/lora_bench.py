"""Multi-LoRA decode cost on the embedded SmolLM2-135M: one decode step of a batch of
`--batch` requests holding `--context` tokens of KV each, with `--adapters` random rank
`--rank` adapters on all seven projections mixed in the batch (request i under adapter
i mod N), beside the same step of the base model alone (a runner without LoRA). ms/step,
median. Results: docs/benchmarks/lora.md.

    .venv/bin/python -m benchmarks.lora_bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

# isort: off
import engine  # noqa: F401  first: it sets the OpenMP defaults before torch loads OpenMP
import torch

# isort: on
from safetensors.torch import save_file

from benchmarks.model_bench import DecodeBench
from engine.lora import TARGET_MODULES, LoRAManager
from engine.model.config import ModelConfig
from engine.model.forward_batch import ForwardBatch
from testing.batches import build_forward_batch


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of one layer."""
    hidden, inter, head = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(path: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """A random PEFT adapter on every target projection of every layer."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for name, (n_in, n_out) in projection_shapes(config).items():
            part = "self_attn" if name in TARGET_MODULES[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=generator)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    lora_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    (path / "adapter_config.json").write_text(
        json.dumps(lora_config | {"target_modules": list(TARGET_MODULES)})
    )
    return path


def step_seconds(bench: DecodeBench, slots: torch.Tensor | None) -> float:
    """One decode step's seconds, adapters per `slots` (None: the base model)."""
    forward_batch = build_forward_batch(bench.runner, bench.batches[0])
    forward_batch.lora_slots = slots
    return _timed(bench, forward_batch)


def _timed(bench: DecodeBench, forward_batch: ForwardBatch) -> float:
    """One step's seconds; the batch's contexts then grow by its token."""
    start = time.perf_counter()
    bench.runner.forward(forward_batch)
    elapsed = time.perf_counter() - start
    batch = bench.batches[0]
    bench.batches[0] = [r._replace(prefix_len=r.prefix_len + 1) for r in batch]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    shapes = [(args.batch, args.context)]
    base = DecodeBench(args.dtype, shapes, args.steps + 1)
    lora = DecodeBench(
        args.dtype,
        shapes,
        args.steps + 1,
        enable_lora=True,
        max_loras_per_batch=args.adapters,
        max_lora_rank=args.rank,
    )
    manager = lora.runner.lora_manager
    assert isinstance(manager, LoRAManager)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            manager.load(
                name, str(write_adapter(Path(tmp) / name, lora.runner.model_config, args.rank, i))
            )
        slots = torch.tensor(manager.acquire([names[i % len(names)] for i in range(args.batch)]))
    slots = slots.to(lora.runner.device)
    base_times, lora_times = [], []
    for _ in range(args.steps + 1):  # interleaved, so that load on the machine hits both
        base_times.append(step_seconds(base, None))
        lora_times.append(step_seconds(lora, slots))
    base_ms = 1000 * statistics.median(base_times[1:])
    lora_ms = 1000 * statistics.median(lora_times[1:])
    device = lora.runner.device
    print(
        json.dumps(
            {
                "device": str(device),
                "dtype": args.dtype,
                "batch": args.batch,
                "context": args.context,
                "adapters": args.adapters,
                "rank": args.rank,
                "base_ms": round(base_ms, 2),
                "lora_ms": round(lora_ms, 2),
                "ratio": round(lora_ms / base_ms, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
