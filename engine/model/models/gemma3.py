"""Gemma 3's text decoder (`Gemma3ForCausalLM`, and the text tower of
`Gemma3ForConditionalGeneration`): the Llama model with per-head q/k norms, five of every
six layers attending to a sliding window and rotating with their own rope base, a GELU-tanh
gated MLP and embeddings scaled by sqrt(hidden) (all `ModelConfig`'s); its own layer has
four norms, around both the attention and the MLP.

Every norm is the Llama RMSNorm, x * w: Gemma's x * (1 + w) is `w + 1` loaded once
(`ModelConfig.norm_weight_offset`; a GGUF file stores 1 + w already)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.model.attention.base import AttentionBackend
from engine.model.config import ModelConfig
from engine.model.layers.linear import CheckpointTensor
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary_embedding import RotaryEmbedding
from engine.model.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# Multimodal checkpoints keep the text tower under one of these prefixes (transformers 5,
# then older); the vision tower and projector are not loaded.
TEXT_TOWER_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."))
TEXT_TOWER_LM_HEAD = "language_model.lm_head."
VISION_TENSORS = ("vision_tower", "multi_modal_projector")


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """The Llama layer with two more norms: after the attention and after the MLP, each
    before its residual add. A decode batch runs as the same one op as Llama's
    (`decode_norms` gives it the four norms and the q/k norms)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        attn_backend: AttentionBackend,
    ):
        super().__init__(config, layer_id, rotary_emb, attn_backend)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def feed_forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual

    def decode_norms(self) -> list[RMSNorm | None]:
        attn = self.self_attn
        return [
            self.input_layernorm,
            attn.q_norm,
            attn.k_norm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        ]


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma3DecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        super().load_weights(self._text_weights(weights))

    def _text_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        """The text tower's tensors under `Gemma3ForCausalLM` names, norms offset."""
        offset = self.config.norm_weight_offset
        for name, tensor in weights:
            if any(part in name for part in VISION_TENSORS):
                continue
            for prefix, text_prefix in TEXT_TOWER_PREFIXES:
                if name.startswith(prefix):
                    name = text_prefix + name.removeprefix(prefix)
            name = name.replace(TEXT_TOWER_LM_HEAD, "lm_head.")
            if offset and name.endswith("norm.weight"):  # 1 + w in float32 at least
                weight = tensor.narrow(0, 0, tensor.shape[0])
                tensor = weight.to(torch.promote_types(weight.dtype, torch.float32)) + offset
            yield name, tensor
