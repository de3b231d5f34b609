"""Qwen3: the Llama decoder with an RMSNorm over each head of q and k before rotary."""

from __future__ import annotations

from engine.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Weights and layers as Llama's plus `q_norm`/`k_norm`; ModelConfig sets `qk_norm`."""
