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
}
# general.architecture of a GGUF file -> the Hugging Face architecture whose weights it holds.
GGUF_ARCH_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class ModelConfig:
    """The shape and constants a model, its KV pool and its rotary table are built from.

    `rope_scaling` is Hugging Face's rope parameters minus `rope_theta` (None for plain
    RoPE). `rope_freq_factors` is how llama.cpp stores llama3 scaling in a GGUF: one divisor
    per rotary frequency. `context_len` is already capped by a sliding window, if any, since
    attention inside the window is plain causal attention.
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
        """From a Hugging Face `config.json`: a dict, the file, or the directory holding it."""
        if isinstance(config, Mapping):
            hf: Mapping[str, Any] = config
        else:
            path = Path(config)
            hf = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        model_type = hf.get("model_type", "")
        architectures = hf.get("architectures") or [
            MODEL_TYPE_TO_ARCHITECTURE.get(model_type, model_type)
        ]
        rope_theta, rope_scaling = _hf_rope(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        context_len = hf["max_position_embeddings"]
        if hf.get("use_sliding_window", True) and hf.get("sliding_window"):
            context_len = min(context_len, hf["sliding_window"])
        eos = hf.get("eos_token_id")
        return cls(
            architecture=architectures[0],
            num_hidden_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            vocab_size=hf["vocab_size"],
            rms_norm_eps=hf["rms_norm_eps"],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            context_len=context_len,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama and Qwen3 say so in
            # attention_bias.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_proj_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,),
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
        eos_keys = (
            gguf.Keys.Tokenizer.EOS_ID,
            gguf.Keys.Tokenizer.EOT_ID,
            gguf.Keys.Tokenizer.EOM_ID,
        )
        return cls(
            architecture=GGUF_ARCH_TO_ARCHITECTURE[arch],
            num_hidden_layers=key(gguf.Keys.LLM.BLOCK_COUNT),
            hidden_size=hidden_size,
            intermediate_size=key(gguf.Keys.LLM.FEED_FORWARD_LENGTH),
            num_attention_heads=num_heads,
            num_key_value_heads=key(gguf.Keys.Attention.HEAD_COUNT_KV, num_heads),
            head_dim=key(gguf.Keys.Attention.KEY_LENGTH, hidden_size // num_heads),
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
        )


def _hf_rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling parameters, from transformers 5 `rope_parameters` or the
    older `rope_theta` + `rope_scaling` (whose type may be spelled `type`)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return rope_theta, None
    return rope_theta, {"rope_type": rope_type, **params}


def _is_vocab_field(name: str) -> bool:
    """The per-token arrays (tens of thousands of strings) are the tokenizer's business."""
    return name in (
        gguf.Keys.Tokenizer.LIST,
        gguf.Keys.Tokenizer.TOKEN_TYPE,
        gguf.Keys.Tokenizer.SCORES,
        gguf.Keys.Tokenizer.MERGES,
    )
