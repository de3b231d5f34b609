"""The networks, by Hugging Face architecture name."""

from __future__ import annotations

from engine.model.models.gemma3 import Gemma3ForCausalLM
from engine.model.models.llama import LlamaForCausalLM
from engine.model.models.qwen2 import Qwen2ForCausalLM
from engine.model.models.qwen3 import Qwen3ForCausalLM

# Every supported architecture is the Llama model with ModelConfig flags (Gemma 3 with a
# layer of its own).
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"model architecture {architecture!r} is not supported "
            f"(supported: {', '.join(MODEL_REGISTRY)})"
        ) from None
