"""One description of a decoder-only transformer, whether it came from config.json or GGUF."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Hugging Face model_type -> architecture, for configs that omit "architectures".
MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}
# general.architecture of a GGUF file -> the Hugging Face architecture whose weights it holds.
GGUF_ARCH_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
GEMMA3_SLIDING_WINDOW_PATTERN = 6
"""Gemma 3 makes every sixth layer global; its GGUF does not say so (llama.cpp's rule)."""
GEMMA3_LOCAL_ROPE_THETA = 10000.0
"""The sliding layers' rope base of Gemma 3, which its GGUF does not carry either."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape and constants a model, its KV pool and its rotary table are built from.

    `rope_scaling` is Hugging Face's rope parameters minus `rope_theta` (None for plain
    RoPE). `rope_freq_factors` is how llama.cpp stores llama3 scaling in a GGUF: one divisor
    per rotary frequency.

    `layer_types` names each layer's attention, `full_attention` or `sliding_attention`
    (Hugging Face's words; empty: all full): a sliding layer's query at position p sees the
    keys in (p - `sliding_window`, p]. Such layers rotate with `sliding_rope_theta` and no
    scaling where that is set (Gemma 3's local layers). `query_scale` multiplies q.k (None:
    1/sqrt(head_dim)); `embedding_scale` the embeddings, in the activations' dtype (Gemma:
    sqrt(hidden)). `norm_weight_offset` is added to every RMSNorm weight at load: Gemma
    checkpoints store w for its x * (1 + w), while its GGUF files store 1 + w already.
    """

    architecture: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    context_len: int
    tie_word_embeddings: bool
    rope_scaling: Mapping[str, Any] | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    sliding_rope_theta: float | None = None
    query_scale: float | None = None
    embedding_scale: float | None = None
    norm_weight_offset: float = 0.0

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"activation {self.hidden_act!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
            )
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"{len(self.layer_types)} layer types for {self.num_hidden_layers} layers"
            )
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of layer `layer_id`, None where it attends to everything."""
        if self.layer_types and self.layer_types[layer_id] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def is_hybrid_swa(self) -> bool:
        """Some layers slide and some do not (SGLang's term): the KV of the two kinds
        outlives the window differently."""
        return SLIDING_ATTENTION in self.layer_types and FULL_ATTENTION in self.layer_types

    def get_num_kv_heads(self, tp_size: int) -> int:
        """KV heads per rank: an even share, or one (replicated) when the ranks outnumber
        the KV heads (SGLang's name)."""
        return max(1, self.num_key_value_heads // tp_size)

    def verify_tp_size(self, tp_size: int) -> None:
        """Refuse a tensor-parallel size the model cannot be split over. The vocabulary is
        padded to a multiple of it, so only the heads and the MLP width can refuse."""
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        problem = None
        if heads % tp_size:
            problem = f"the {heads} attention heads"
        elif kv_heads % tp_size and tp_size % kv_heads:
            problem = (
                f"the {kv_heads} KV heads (and {tp_size} is not a multiple of them, "
                f"so they cannot be replicated either)"
            )
        elif self.intermediate_size % tp_size:
            problem = f"the MLP's intermediate size {self.intermediate_size}"
        if problem is not None:
            raise ValueError(
                f"--tp-size {tp_size} does not divide {problem} of this model; "
                f"choose a --tp-size that does"
            )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> ModelConfig:
        """From a Hugging Face `config.json`: a dict, the file, or the directory holding it.
        A multimodal Gemma 3 checkpoint is read as its text tower."""
        if isinstance(config, Mapping):
            hf: Mapping[str, Any] = config
        else:
            path = Path(config)
            hf = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        model_type = hf.get("model_type", "")
        architectures = hf.get("architectures") or [
            MODEL_TYPE_TO_ARCHITECTURE.get(model_type, model_type)
        ]
        if "text_config" in hf:  # the text tower, whose config.json leaves out its defaults
            from transformers import AutoConfig

            text = AutoConfig.for_model(**hf["text_config"]).to_dict()
            hf = {**text, **{k: hf[k] for k in ("eos_token_id", "bos_token_id") if k in hf}}
            model_type = text["model_type"]
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(key) is not None:
                raise ValueError(f"{key} is not supported (this config sets {hf[key]})")
        gemma = model_type.startswith("gemma")
        rope_theta, rope_scaling, sliding_rope_theta = _hf_rope(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        context_len = hf["max_position_embeddings"]
        eos = hf.get("eos_token_id")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        return cls(
            architecture=architectures[0],
            num_hidden_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=head_dim,
            vocab_size=hf["vocab_size"],
            rms_norm_eps=hf["rms_norm_eps"],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            context_len=context_len,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama and Qwen3 say so in
            # attention_bias.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_proj_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3" or gemma,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,),
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
            layer_types=_hf_layer_types(hf, model_type),
            sliding_window=hf.get("sliding_window"),
            sliding_rope_theta=sliding_rope_theta,
            query_scale=hf["query_pre_attn_scalar"] ** -0.5
            if hf.get("query_pre_attn_scalar")
            else None,
            embedding_scale=hf["hidden_size"] ** 0.5 if gemma else None,
            norm_weight_offset=1.0 if gemma else 0.0,
        )

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> ModelConfig:
        """From a GGUF file's metadata; the tensor list tells biases, Q/K norms and tying apart."""
        fields = {
            name: field.contents()
            for name, field in reader.fields.items()
            if not _is_vocab_field(name)
        }
        arch = fields[gguf.Keys.General.ARCHITECTURE]
        if arch not in GGUF_ARCH_TO_ARCHITECTURE:
            raise ValueError(
                f"GGUF architecture {arch!r} is not supported "
                f"(supported: {', '.join(GGUF_ARCH_TO_ARCHITECTURE)})"
            )

        def key(template: str, default: Any = None) -> Any:
            value = fields.get(template.format(arch=arch), default)
            if value is None:
                raise ValueError(f"GGUF file lacks {template.format(arch=arch)}")
            return value

        tensors = {tensor.name: tensor for tensor in reader.tensors}
        hidden_size = key(gguf.Keys.LLM.EMBEDDING_LENGTH)
        num_heads = key(gguf.Keys.Attention.HEAD_COUNT)
        vocab_size = fields.get(gguf.Keys.LLM.VOCAB_SIZE.format(arch=arch))
        if vocab_size is None:
            vocab_size = len(reader.fields[gguf.Keys.Tokenizer.LIST].data)
        scaling_type = key(gguf.Keys.Rope.SCALING_TYPE, "none")
        rope_scaling = None
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": key(gguf.Keys.Rope.SCALING_FACTOR)}
        elif scaling_type != "none":
            raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
        rope_freqs = tensors.get("rope_freqs.weight")
        num_layers = key(gguf.Keys.LLM.BLOCK_COUNT)
        head_dim = key(gguf.Keys.Attention.KEY_LENGTH, hidden_size // num_heads)
        gemma = arch == "gemma3"
        layer_types = _every_nth_full(num_layers, GEMMA3_SLIDING_WINDOW_PATTERN) if gemma else ()
        eos_keys = (
            gguf.Keys.Tokenizer.EOS_ID,
            gguf.Keys.Tokenizer.EOT_ID,
            gguf.Keys.Tokenizer.EOM_ID,
        )
        return cls(
            architecture=GGUF_ARCH_TO_ARCHITECTURE[arch],
            num_hidden_layers=num_layers,
            hidden_size=hidden_size,
            intermediate_size=key(gguf.Keys.LLM.FEED_FORWARD_LENGTH),
            num_attention_heads=num_heads,
            num_key_value_heads=key(gguf.Keys.Attention.HEAD_COUNT_KV, num_heads),
            head_dim=head_dim,
            vocab_size=vocab_size,
            rms_norm_eps=key(gguf.Keys.Attention.LAYERNORM_RMS_EPS),
            rope_theta=key(gguf.Keys.Rope.FREQ_BASE, 10000.0),
            rope_scaling=rope_scaling,
            rope_freq_factors=None
            if rope_freqs is None
            else tuple(np.asarray(rope_freqs.data, np.float32).tolist()),
            context_len=key(gguf.Keys.LLM.CONTEXT_LENGTH),
            tie_word_embeddings="output.weight" not in tensors,
            qkv_bias="blk.0.attn_q.bias" in tensors,
            o_proj_bias="blk.0.attn_output.bias" in tensors,
            mlp_bias="blk.0.ffn_up.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            bos_token_id=fields.get(gguf.Keys.Tokenizer.BOS_ID),
            eos_token_ids=tuple(dict.fromkeys(fields[k] for k in eos_keys if k in fields)),
            hidden_act="gelu_pytorch_tanh" if gemma else "silu",
            layer_types=layer_types,
            sliding_window=fields.get(gguf.Keys.Attention.SLIDING_WINDOW.format(arch=arch)),
            sliding_rope_theta=GEMMA3_LOCAL_ROPE_THETA if gemma else None,
            query_scale=_gemma3_gguf_query_scale(num_layers, hidden_size, num_heads, head_dim)
            if gemma
            else None,
            embedding_scale=hidden_size**0.5 if gemma else None,
        )


def _gemma3_gguf_query_scale(
    num_layers: int, hidden_size: int, num_heads: int, head_dim: int
) -> float:
    """llama.cpp's rule for a `gemma3` GGUF, which carries no `query_pre_attn_scalar`:
    1/sqrt(head_dim), except the 27B model (62 layers), which scales by hidden / heads."""
    return (hidden_size / num_heads if num_layers == 62 else head_dim) ** -0.5


def _hf_rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, float | None]:
    """rope_theta and the scaling parameters of the full-attention layers, and the sliding
    layers' own rope_theta where they have one: from transformers 5 `rope_parameters` (one
    per layer type where they differ) or the older `rope_theta` + `rope_scaling` (whose type
    may be spelled `type`) + Gemma 3's `rope_local_base_freq`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    sliding_theta = config.get("rope_local_base_freq")
    if FULL_ATTENTION in params:
        sliding = params.get(SLIDING_ATTENTION) or {}
        if sliding.get("rope_type", "default") != "default":
            raise ValueError(f"sliding layers' rope type {sliding['rope_type']!r} is not supported")
        sliding_theta = sliding.get("rope_theta", sliding_theta)
        params = dict(params[FULL_ATTENTION])
    rope_theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    sliding = None if sliding_theta is None else float(sliding_theta)
    if rope_type == "default":
        return rope_theta, None, sliding
    return rope_theta, {"rope_type": rope_type, **params}, sliding


def _hf_layer_types(config: Mapping[str, Any], model_type: str) -> tuple[str, ...]:
    """Each layer's attention: the config's `layer_types`, else what older configs imply (a
    Gemma 3 sliding-window pattern; Mistral's window on every layer; Qwen2's from
    `max_window_layers` on, when `use_sliding_window`)."""
    layers = config["num_hidden_layers"]
    if config.get("layer_types"):
        return tuple(config["layer_types"])
    if not config.get("sliding_window") or not config.get("use_sliding_window", True):
        return ()
    if model_type.startswith("gemma3"):
        pattern = config.get("sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
        return _every_nth_full(layers, pattern)
    first_sliding = config.get("max_window_layers", 0) if model_type == "qwen2" else 0
    return tuple(SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(layers))


def _every_nth_full(num_layers: int, n: int) -> tuple[str, ...]:
    """Sliding layers with every `n`-th layer global (Gemma 3's pattern)."""
    return tuple(
        FULL_ATTENTION if (i + 1) % n == 0 else SLIDING_ATTENTION for i in range(num_layers)
    )


def _is_vocab_field(name: str) -> bool:
    """The per-token arrays (tens of thousands of strings) are the tokenizer's business."""
    return name in (
        gguf.Keys.Tokenizer.LIST,
        gguf.Keys.Tokenizer.TOKEN_TYPE,
        gguf.Keys.Tokenizer.SCORES,
        gguf.Keys.Tokenizer.MERGES,
    )
