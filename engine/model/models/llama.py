"""The Llama decoder (Llama 2/3, SmolLM2, Mistral without a sliding window), which Qwen2 and
Qwen3 reuse: their differences (q/k/v biases, per-head q/k RMSNorm) are ModelConfig flags.

Tensor parallel in Megatron's layout: each rank holds its share of the heads and of the MLP
width, so a layer costs two all-reduces (after o_proj and after down_proj) and the
embedding one. Per-head q/k norms and the q/k/v biases follow their heads' rows."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.distributed import get_tp_group
from engine.model.attention.base import AttentionBackend, AttentionLayer
from engine.model.config import ModelConfig
from engine.model.forward_batch import ForwardBatch
from engine.model.layers.activation import SiluAndMul
from engine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model.layers.linear import (
    CheckpointTensor,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    get_weight_loader,
)
from engine.model.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from engine.model.layers.norm import RMSNorm
from engine.model.layers.radix_attention import RadixAttention
from engine.model.layers.rotary_embedding import RotaryEmbedding


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, {"gate": inter, "up": inter}, config.mlp_bias
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, config.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        attn_backend: AttentionBackend,
    ):
        super().__init__()
        tp_size = get_tp_group().size
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.get_num_kv_heads(tp_size)
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, config.o_proj_bias
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary_emb = rotary_emb
        layer = AttentionLayer(
            layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )
        self.attn = RadixAttention(layer, attn_backend)

    def forward(
        self, cos_sin: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """q and k are rotated together, in place in the qkv projection's output: q, k and v
        reach the backend as views of it (last dim contiguous, rows strided)."""
        num_tokens = hidden_states.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden_states).view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        qk, v = qkv.split([heads + kv_heads, kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([heads, kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        self.rotary_emb(qk, cos_sin)
        q, k = qk.split([heads, kv_heads], dim=1)
        out = self.attn(q, k, v, forward_batch)
        return self.o_proj(out.reshape(num_tokens, heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary_emb: RotaryEmbedding,
        attn_backend: AttentionBackend,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary_emb, attn_backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        cos_sin: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next
        layer's norm adds the two (in place into the residual)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(cos_sin, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.context_len,
            config.rope_theta,
            config.rope_scaling,
            config.rope_freq_factors,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, layer_id, self.rotary_emb, attn_backend)
            for layer_id in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        # Every layer rotates by the same positions: gathered once, as transformers does.
        cos_sin = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        for layer in self.layers:
            hidden_states, residual = layer(cos_sin, hidden_states, residual, forward_batch)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections that live inside one fused parameter: (fused, checkpoint, shard_id).
    stacked_params_mapping = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", "gate"),
        (".gate_up_proj.", ".up_proj.", "up"),
    )

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attn_backend)
        self.lm_head = (
            self.model.embed_tokens
            if config.tie_word_embeddings
            else ParallelLMHead(config.vocab_size, config.hidden_size)
        )
        self.logits_processor = LogitsProcessor()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        """Logits `[batch, vocab]`, one row per request for the position it samples next, and
        the prompt logprobs the batch asks for."""
        hidden_states = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy this rank's slice of each checkpoint tensor (Hugging Face names) into the
        parameters; fail if any tensor has no parameter or any parameter is left partly
        unfilled."""
        params = dict(self.named_parameters())
        filled = dict.fromkeys(params, 0)
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and self.config.tie_word_embeddings
            ):
                continue
            shard_id = None
            for fused, original, shard in self.stacked_params_mapping:
                if original in name:
                    name, shard_id = name.replace(original, fused), shard
                    break
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}"
                )
            param = params[name]
            filled[name] += get_weight_loader(param)(param, tensor, shard_id)
        unfilled = [name for name, param in params.items() if filled[name] != param.numel()]
        if unfilled:
            raise ValueError(f"checkpoint does not fill {unfilled}")
