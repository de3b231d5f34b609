"""ModelConfig from Hugging Face config.json (old and new rope layouts) and from GGUF metadata."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from engine.model.config import ModelConfig
from engine.model.embedded import GEMMA3_MODEL, embedded_model_path
from engine.model.source import GGUFReader

LLAMA31_CONFIG = {  # config.json of Llama-3.1-8B-Instruct as written by transformers 4.x
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def test_llama31_config_json_gives_llama3_rope_and_every_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_CONFIG))
    config = ModelConfig.from_hf(tmp_path)
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {**LLAMA31_CONFIG["rope_scaling"], "rope_type": "llama3"}
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.context_len == 131072
    assert not (
        config.qkv_bias or config.o_proj_bias or config.qk_norm or config.tie_word_embeddings
    )


def test_transformers5_rope_parameters_are_read_like_the_old_layout():
    new_layout = {
        k: v for k, v in LLAMA31_CONFIG.items() if k not in ("rope_theta", "rope_scaling")
    }
    new_layout["rope_parameters"] = {**LLAMA31_CONFIG["rope_scaling"], "rope_theta": 500000.0}
    assert ModelConfig.from_hf(new_layout) == ModelConfig.from_hf(LLAMA31_CONFIG)


def test_legacy_rope_scaling_type_key_and_default_rope():
    linear = ModelConfig.from_hf(
        {**LLAMA31_CONFIG, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    plain = ModelConfig.from_hf({**LLAMA31_CONFIG, "rope_scaling": None})
    assert plain.rope_scaling is None and plain.rope_theta == 500000.0


def test_unsupported_rope_type_is_rejected_at_config_time():
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        ModelConfig.from_hf(
            {**LLAMA31_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
        )


def test_qwen2_has_qkv_bias_and_qwen3_has_qk_norm():
    qwen2 = ModelConfig.from_hf(
        {
            **LLAMA31_CONFIG,
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "use_sliding_window": False,
            "sliding_window": 4096,
        }
    )
    assert qwen2.qkv_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    assert qwen2.context_len == 131072  # the window is off
    qwen3 = ModelConfig.from_hf(
        {
            **LLAMA31_CONFIG,
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "head_dim": 128,
        }
    )
    assert qwen3.qk_norm and not qwen3.qkv_bias


def test_mistral_sliding_window_applies_to_every_layer_not_the_context():
    mistral = ModelConfig.from_hf(
        {**LLAMA31_CONFIG, "architectures": None, "model_type": "mistral", "sliding_window": 4096}
    )
    assert mistral.architecture == "MistralForCausalLM"
    assert mistral.context_len == LLAMA31_CONFIG["max_position_embeddings"]
    assert mistral.layer_types == ("sliding_attention",) * mistral.num_hidden_layers
    assert mistral.layer_window(0) == 4096 and not mistral.is_hybrid_swa


def test_qwen2_window_starts_at_max_window_layers():
    qwen2 = ModelConfig.from_hf(
        {
            **LLAMA31_CONFIG,
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 64,
            "max_window_layers": 30,
        }
    )
    assert [qwen2.layer_window(i) for i in (0, 29, 30, 31)] == [None, None, 64, 64]
    assert qwen2.is_hybrid_swa


def test_gemma3_gguf_metadata_agrees_with_transformers():
    """The file leaves out what llama.cpp hard-codes for `gemma3` (every sixth layer global,
    the local rope base, the query scale): the config supplies it as transformers does."""
    path = embedded_model_path(GEMMA3_MODEL)
    ours = ModelConfig.from_gguf(GGUFReader(path))
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert ours.architecture == "Gemma3ForCausalLM"
    assert ours.layer_types == tuple(theirs.layer_types)
    assert ours.layer_types.count("full_attention") == 3 and ours.is_hybrid_swa
    assert ours.sliding_window == theirs.sliding_window == 512
    assert ours.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert ours.sliding_rope_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.query_scale == theirs.query_pre_attn_scalar**-0.5 == 256**-0.5
    assert ours.embedding_scale == theirs.hidden_size**0.5
    assert ours.hidden_act == theirs.hidden_activation == "gelu_pytorch_tanh"
    assert (ours.num_attention_heads, ours.num_key_value_heads, ours.head_dim) == (4, 1, 256)
    assert ours.qk_norm and ours.tie_word_embeddings and ours.vocab_size == 262144
    assert ours.norm_weight_offset == 0.0  # the file stores 1 + w


def test_a_multimodal_gemma3_config_is_read_as_its_text_tower_with_defaults():
    """config.json of a Gemma3ForConditionalGeneration keeps only the text tower's
    non-default keys; the rest come from transformers' Gemma3TextConfig."""
    config = ModelConfig.from_hf(
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "eos_token_id": [1, 106],
            "text_config": {
                "model_type": "gemma3_text",
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
            "vision_config": {"model_type": "siglip_vision_model"},
        }
    )
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 256)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.sliding_rope_theta == 10000.0 and config.rope_theta == 1e6
    assert [config.layer_window(i) for i in (4, 5, 6)] == [1024, None, 1024]
    assert config.eos_token_ids == (1, 106) and config.norm_weight_offset == 1.0


def test_logit_softcapping_is_refused():
    with pytest.raises(ValueError, match="final_logit_softcapping is not supported"):
        ModelConfig.from_hf({**LLAMA31_CONFIG, "final_logit_softcapping": 30.0})


def test_embedded_gguf_metadata_agrees_with_transformers():
    path = embedded_model_path()
    ours = ModelConfig.from_gguf(GGUFReader(path))
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert ours.architecture == "LlamaForCausalLM"
    assert ours.num_hidden_layers == theirs.num_hidden_layers == 30
    assert ours.hidden_size == theirs.hidden_size
    assert ours.intermediate_size == theirs.intermediate_size
    assert ours.num_attention_heads == theirs.num_attention_heads
    assert ours.num_key_value_heads == theirs.num_key_value_heads
    assert ours.head_dim == theirs.head_dim == 64
    assert ours.vocab_size == theirs.vocab_size
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.context_len == theirs.max_position_embeddings
    assert ours.tie_word_embeddings and theirs.tie_word_embeddings
    assert ours.bos_token_id == theirs.bos_token_id and ours.eos_token_ids == (theirs.eos_token_id,)
