"""Multi-LoRA serving: PEFT adapters applied per token in mixed batches (docs/architecture.md,
"Tensor parallelism, LoRA, limits and trust"; docs/benchmarks/lora.md for the step's cost)."""

from engine.lora.adapter import TARGET_MODULES, LoRAAdapter, load_adapter
from engine.lora.errors import LoRAError
from engine.lora.layers import LoRABatchInfo, LoRALayer
from engine.lora.manager import NO_ADAPTER, LoRAManager

__all__ = [
    "NO_ADAPTER",
    "TARGET_MODULES",
    "LoRAAdapter",
    "LoRABatchInfo",
    "LoRAError",
    "LoRALayer",
    "LoRAManager",
    "load_adapter",
]
