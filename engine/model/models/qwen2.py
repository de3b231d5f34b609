"""Qwen2: the Llama decoder with biases on the q, k and v projections."""

from __future__ import annotations

from engine.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Weights and layers as Llama's; ModelConfig sets `qkv_bias` for this architecture."""
