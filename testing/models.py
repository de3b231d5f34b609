"""Tiny random-weight Hugging Face models (Llama, Qwen2, Qwen3), optionally saved with a real
tokenizer: they load in a second, so tests and the soak exercise the engine and the serving
machinery rather than a model. And transformers' own reading of the embedded GGUF, the
reference that the engine's numbers are checked against.

Weights are drawn wider than transformers' init, and norm weights away from 1: logits are
then far from flat, so greedy choices are clear-cut rather than near-ties, and a misplaced
tensor moves them by far more than any test's tolerance. The same arguments give the same
weights.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from engine.model.embedded import EMBEDDED_MODEL, embedded_model_path
from engine.model.tokenizer_cache import load_tokenizer

TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
"""Two layers of width 64 with grouped-query attention (4 heads, 2 KV heads of 16)."""
LLAMA3_ROPE: dict[str, Any] = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    # Wavelengths of a 16-wide head at theta 1e4 run from 6 to 19000 positions: with 64,
    # some frequencies are kept, some divided by 8 and some interpolated.
    original_max_position_embeddings=64,
)
TINY_SLIDING_WINDOW = 8
GEMMA3_OVERRIDES: dict[str, Any] = dict(
    tie_word_embeddings=True,
    head_dim=32,
    sliding_window=TINY_SLIDING_WINDOW,
    layer_types=["sliding_attention", "full_attention"],
    query_pre_attn_scalar=24,  # not head_dim: a scale taken from the wrong place shows
    rope_parameters={
        "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
        "sliding_attention": dict(rope_type="default", rope_theta=1e4),
    },
)
"""Gemma 3 in two layers, one sliding over 8 tokens and one global (whose rope alone is
scaled, as in the 4B and larger models)."""
TINY_ARCHS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "llama3_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(tie_word_embeddings=False, rope_parameters=dict(rope_theta=1e6)),
    ),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True, head_dim=32)),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, GEMMA3_OVERRIDES),
}
"""name -> (config class, model class, config overrides). Each variant exercises what the
others do not: tied and untied output heads, llama3 RoPE scaling, Qwen2's q/k/v biases,
Qwen3's q/k norms and a head width that is not hidden / heads, Gemma 3's sliding window."""
TINY_LLAMA_CONTEXT = 8192
"""The context of `save_tiny_llama`'s model: longer than the service tests' KV pools, so a
request can fit the context but never the pool."""


def tiny_hf_model(
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    weight_scale: float = 0.3,
    **config: Any,
) -> PreTrainedModel:
    """A TINY_ARCHS model in eval mode: TINY_CONFIG with the variant's and then `config`'s
    overrides, weights drawn in `dtype` from `seed` (norm weights 1 + 0.2 N(0, 1), all
    others `weight_scale` N(0, 1))."""
    config_cls, model_cls, arch_overrides = TINY_ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY_CONFIG, **arch_overrides, **config}))
    model = model.to(dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            param.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else weight_scale * noise)
    return model


def save_tiny_model(
    path: Path,
    arch: str = "llama",
    *,
    tokenizer: str | None = None,
    added_tokens: Sequence[str] = (),
    **model_args: Any,
) -> Path:
    """`tiny_hf_model(arch, **model_args)` saved as a Hugging Face directory at `path`.

    With `tokenizer` (a model path `load_tokenizer` knows, e.g. "embedded"), that tokenizer
    is saved beside it and sets the vocabulary size and the BOS and EOS ids, so the model
    reads and writes real text; `added_tokens` join its vocabulary as single tokens.
    """
    if tokenizer is not None:
        loaded = load_tokenizer(tokenizer)
        loaded.add_tokens(list(added_tokens))
        loaded.save_pretrained(path)
        model_args = {
            "vocab_size": len(loaded),
            "bos_token_id": loaded.bos_token_id,
            "eos_token_id": loaded.eos_token_id,
            **model_args,
        }
    tiny_hf_model(arch, **model_args).save_pretrained(path)
    return path


def save_tiny_llama(path: Path) -> Path:
    """The tiny Llama with the embedded SmolLM2's tokenizer and a TINY_LLAMA_CONTEXT-token
    context: what the service tests and the soak serve."""
    return save_tiny_model(path, tokenizer="embedded", max_position_embeddings=TINY_LLAMA_CONTEXT)


def save_tiny_thinking_llama(path: Path) -> Path:
    """The tiny Llama of `save_tiny_llama` whose vocabulary also has `<think>` and
    `</think>` as single tokens, as reasoning models' do."""
    return save_tiny_model(
        path,
        tokenizer="embedded",
        added_tokens=("<think>", "</think>"),
        max_position_embeddings=TINY_LLAMA_CONTEXT,
    )


@functools.cache
def embedded_hf_model(name: str = EMBEDDED_MODEL) -> PreTrainedModel:
    """transformers' float32 model from an embedded GGUF, through transformers' own GGUF
    reader and dequantizer (what `from_pretrained(gguf_file=...)` does, minus `accelerate`).

    Read once per process (20-60 s of mostly single-threaded parsing) and shared: callers
    only run it in eval mode."""
    path = embedded_model_path(name)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model
