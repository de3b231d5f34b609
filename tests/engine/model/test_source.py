"""Finding a model and reading its description without torch: what `radixserve serve`
refuses before it starts, and what it leaves to the loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.model.models import MODEL_REGISTRY
from engine.model.source import SUPPORTED_ARCHITECTURES, local_config


def test_the_supported_architectures_are_the_registered_networks():
    assert sorted(SUPPORTED_ARCHITECTURES) == sorted(MODEL_REGISTRY)


def test_a_hub_repo_id_is_left_to_the_loader():
    assert local_config("radixserve-tests/no-such-model") is None


def test_a_missing_local_path_is_refused_without_asking_the_hub(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        local_config(str(tmp_path / "model"))


def test_an_unsupported_hugging_face_architecture_is_refused_naming_the_supported(
    tmp_path: Path,
):
    config = {
        "architectures": ["GemmaForCausalLM"],
        "num_hidden_layers": 1,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "vocab_size": 16,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'GemmaForCausalLM' is not supported") as refusal:
        local_config(str(tmp_path))
    assert ", ".join(SUPPORTED_ARCHITECTURES) in str(refusal.value)


def test_a_config_that_lacks_a_key_is_refused_naming_it(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json lacks 'max_position_embeddings'"):
        local_config(str(tmp_path))


def test_the_embedded_model_is_read():
    config = local_config("embedded")
    assert config is not None and config.architecture == "LlamaForCausalLM"
