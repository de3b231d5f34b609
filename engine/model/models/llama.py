"""The Llama decoder (Llama 2/3, SmolLM2, Mistral without a sliding window), which Qwen2 and
Qwen3 reuse: their differences (q/k/v biases, per-head q/k RMSNorm) are ModelConfig flags.

Tensor parallel in Megatron's layout: each rank holds its share of the heads and of the MLP
width, so a layer costs two all-reduces (after o_proj and after down_proj) and the
embedding one. Per-head q/k norms and the q/k/v biases follow their heads' rows."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from engine.distributed import get_tp_group
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.custom_op import cpu_kernels_on
from engine.model.attention.base import AttentionBackend, AttentionLayer, CpuDecodeInputs
from engine.model.config import ModelConfig
from engine.model.forward_batch import ForwardBatch
from engine.model.layers.activation import GATED_ACTIVATIONS, GeluAndMul, SiluAndMul
from engine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model.layers.linear import (
    CheckpointTensor,
    Linear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    get_weight_loader,
)
from engine.model.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from engine.model.layers.norm import RMSNorm
from engine.model.layers.radix_attention import RadixAttention
from engine.model.layers.rotary_embedding import RotaryEmbedding


class DecodeOpWeights(NamedTuple):
    """A layer's weights as `cpu_ops.decode_layer` takes them: its six norms (`decode_norms`,
    None where it has none), each projection as parts of its output rows (a weight and its
    AMX-packed copy, or the quantized weight twice, for each part), each part's format (a
    quantized one, `quantization.WeightFormat`, or -1 for bf16), how many parts each of the
    four projections has, and its gated activation (`DECODE_OP_ACTIVATIONS`)."""

    norms: list[torch.Tensor | None]
    projections: list[torch.Tensor]
    formats: list[int]
    parts: list[int]
    activation: str
    activation_bits: int


DECODE_OP_ACTIVATIONS: dict[type[nn.Module], str] = {SiluAndMul: "silu", GeluAndMul: "gelu_tanh"}
"""The gated activations `cpu_ops.decode_layer` runs, by the name it takes."""


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, {"gate": inter, "up": inter}, config.mlp_bias
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, config.mlp_bias)
        self.act_fn = GATED_ACTIVATIONS[config.hidden_act]()

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
            layer_id,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            config.query_scale or self.head_dim**-0.5,
            sliding_window=config.layer_window(layer_id),
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
        self._decode_weights: DecodeOpWeights | None = None
        self._decode_weights_checked = False

    def forward(
        self,
        cos_sin: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next
        layer's norm adds the two (in place into the residual). A CPU decode batch runs as
        one op where it can (`decode_weights`), else the modules run it."""
        weights = self.decode_weights(hidden_states.dtype)
        inputs = None if weights is None else self.self_attn.attn.cpu_decode_inputs(forward_batch)
        if weights is not None and inputs is not None:
            return self._forward_decode_op(weights, inputs, cos_sin, hidden_states, residual)
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(cos_sin, hidden_states, forward_batch)
        return self.feed_forward(hidden_states, residual)

    def feed_forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From the attention's output: the residual add and norm, the MLP."""
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def decode_norms(self) -> list[RMSNorm | None]:
        """The norms `cpu_ops.decode_layer` applies, in its order: the input norm, the q and
        k norms, the attention-output norm, the residual-add norm before the MLP and the
        MLP-output norm; None where this layer has none."""
        attn = self.self_attn
        return [
            self.input_layernorm,
            attn.q_norm,
            attn.k_norm,
            None,
            self.post_attention_layernorm,
            None,
        ]

    def decode_weights(self, dtype: torch.dtype) -> DecodeOpWeights | None:
        """This layer's weights in `cpu_ops.decode_layer`'s order, where that op can run
        the layer's `dtype` hidden states: eagerly on a CPU with the kernels, each projection
        quantized (whole or in block parts), or bf16 packed for AMX (as the runner packs them
        after loading) under bf16 hidden states; without biases or LoRA, with a gated
        activation the op knows, on one rank. Anything else, the modules run it."""
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not cpu_kernels_on(attn.qkv_proj.weight) or any(p.lora is not None for p in projections):
            return None
        if not self._decode_weights_checked:  # the runner packs the weights before a forward
            self._decode_weights = self._decode_op_weights(projections)
            self._decode_weights_checked = True
        weights = self._decode_weights
        if weights is None or (dtype != torch.bfloat16 and min(weights.formats) < 0):
            return None
        return weights if dtype in (torch.bfloat16, torch.float32) else None

    def _decode_op_weights(self, projections: tuple[Linear, ...]) -> DecodeOpWeights | None:
        activation = DECODE_OP_ACTIVATIONS.get(type(self.mlp.act_fn))
        norms = self.decode_norms()
        if activation is None or len({n.variance_epsilon for n in norms if n is not None}) != 1:
            return None  # the op takes one epsilon
        if get_tp_group().size != 1:
            return None
        tensors: list[torch.Tensor] = []
        formats: list[int] = []
        parts: list[int] = []
        activation_bits = 32
        for p in projections:
            held = None if p.bias is not None else decode_op_parts(p)
            if held is None:
                return None
            for weight, packed, format in held:
                tensors += [weight, packed]
                formats.append(format)
            parts.append(len(held))
            if p.quant_format is not None or p.block_parts:
                activation_bits = p.activation_bits
        norm_weights: list[torch.Tensor | None] = [n if n is None else n.weight for n in norms]
        return DecodeOpWeights(norm_weights, tensors, formats, parts, activation, activation_bits)

    def _forward_decode_op(
        self,
        weights: DecodeOpWeights,
        inputs: CpuDecodeInputs,
        cos_sin: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a decode batch as one C++ op: the same kernels in the same order,
        without a Python dispatch for each."""
        attn = self.self_attn.attn.layer
        out = cpu_ops.decode_layer(
            hidden_states,
            residual,
            weights.norms,
            weights.projections,
            weights.formats,
            weights.parts,
            weights.activation,
            weights.activation_bits,
            cos_sin,
            *inputs,
            attn.num_heads,
            attn.num_kv_heads,
            attn.scaling,
            self.input_layernorm.variance_epsilon,
        )
        return out, hidden_states if residual is None else residual


def decode_op_parts(p: Linear) -> list[tuple[torch.Tensor, torch.Tensor, int]] | None:
    """`p`'s weight as `cpu_ops.decode_layer` takes a projection: (weight, packed copy,
    format) for each part of its output rows (block parts, or the whole weight); None where
    the op cannot read it (a bf16 weight not packed for AMX, a float one)."""
    if p.block_parts:
        return [(part.weight, part.weight, part.format) for part in p.block_parts]
    if p.quant_format is not None:
        return [(p.weight, p.weight, p.quant_format)]
    packed = p.packed_weight
    if p.weight.dtype == torch.bfloat16 and packed is not None and cpu_ops.is_amx_packed(packed):
        return [(p.weight, packed, -1)]
    return None


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm. What differs between families is config:
    `embedding_scale`, and a second rotary table for the sliding layers where they rotate
    with their own base (`sliding_rope_theta`); and the layer class (`decoder_layer`)."""

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        decoder_layer: type[nn.Module] = LlamaDecoderLayer,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_scale = config.embedding_scale
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.context_len,
            config.rope_theta,
            config.rope_scaling,
            config.rope_freq_factors,
        )
        self.rotary_emb_local = (
            None
            if config.sliding_rope_theta is None
            else RotaryEmbedding(config.head_dim, config.context_len, config.sliding_rope_theta)
        )
        self.local_rope = [
            self.rotary_emb_local is not None and config.layer_window(i) is not None
            for i in range(config.num_hidden_layers)
        ]
        self.layers = nn.ModuleList(
            decoder_layer(
                config,
                layer_id,
                self.rotary_emb_local if local else self.rotary_emb,
                attn_backend,
            )
            for layer_id, local in enumerate(self.local_rope)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        dtype = hidden_states.dtype
        if self.embedding_scale is not None:  # rounded to the dtype first, as transformers
            hidden_states = hidden_states * torch.tensor(self.embedding_scale, dtype=dtype)
        # Every layer of a kind rotates by the same positions: gathered once, as transformers.
        cos_sin = self.rotary_emb.cos_sin(positions, dtype)
        cos_sin_local = (
            None
            if self.rotary_emb_local is None
            else self.rotary_emb_local.cos_sin(positions, dtype)
        )
        if forward_batch.on_layers_start is not None:
            forward_batch.on_layers_start()
        for layer, local in zip(self.layers, self.local_rope):
            layer_cos_sin = cos_sin_local if local else cos_sin
            hidden_states, residual = layer(layer_cos_sin, hidden_states, residual, forward_batch)
            if forward_batch.on_layer_end is not None:
                forward_batch.on_layer_end()
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    decoder_layer: type[nn.Module] = LlamaDecoderLayer
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
        self.model = LlamaModel(config, attn_backend, self.decoder_layer)
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
