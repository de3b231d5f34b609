"""vLLM's CPU build as a benchmark peer: the embedded model (SmolLM2-135M-Instruct) converted
to a float32 Hugging Face folder, served by `vllm serve --dtype float32 --enforce-eager`
through its OpenAI-compatible `/v1/completions` (token-id prompts, `ignore_eos`, streamed
with usage), as `../shared/tools/setup-vllm-cpu.sh` sets it up: a venv and the model folder.

float32: on CPUs without AVX512-BF16 or AMX vLLM's bf16 linears fall back to slow torch
ops. `--enforce-eager`: the compiled default takes 5-10 minutes to start on two cores.

One server per peer, not per cell: it takes about a minute to start on two cores. Its
prefix cache is on by default and would carry one cell's prefixes into the next, so the
server runs with `VLLM_SERVER_DEV_MODE=1`, which adds `POST /reset_prefix_cache`, called
before every cell (as radixserve's `/flush_cache`).

`isa="avx2"` serves vLLM as an AVX2-only CPU runs it, on any x86 CPU: its wheel carries
kernels per instruction set (`_C` for AVX512-BF16, `_C_AVX512`, `_C_AVX2`) and picks by
what torch reports, which `vllm_avx2/sitecustomize.py` turns down; PyTorch's and oneDNN's
GEMMs are capped by their own variables. `kernel_libraries()` reads which one its processes
loaded.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

import httpx2

from testing.net import free_ports
from testing.server_process import ServerProcess

SETUP_SCRIPT = "../shared/tools/setup-vllm-cpu.sh"
FLAGS = ("--dtype", "float32", "--enforce-eager", "--served-model-name", "embedded")
KVCACHE_GIB = 2
"""`VLLM_CPU_KVCACHE_SPACE`: 2 GiB holds about 45k float32 tokens of this model, more than
any workload keeps at once."""
RESET_TIMEOUT_S = 120.0
AVX2_SITE = Path(__file__).with_name("vllm_avx2")
"""The folder whose `sitecustomize.py` hides AVX-512 and AMX from the server's torch."""
AVX2_ENV = {
    "PYTHONPATH": str(AVX2_SITE),
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
KERNEL_LIBRARY = re.compile(r"vllm/(_C\w*)\.abi3\.so")


def default_venv() -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / "peer-vllm-cpu"


def default_model() -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / "smollm2-hf"


def missing(venv: Path, model: Path) -> str | None:
    """Why the peer cannot run here (naming the setup script), or None when it can."""
    if not os.access(venv / "bin" / "vllm-shim", os.X_OK):
        return f"no vLLM CPU venv at {venv} (bin/vllm-shim); run {SETUP_SCRIPT}"
    if not (model / "config.json").exists():
        return f"no Hugging Face model folder at {model}; run {SETUP_SCRIPT}"
    return None


def server_env(venv: Path, isa: str | None = None) -> dict[str, str]:
    """The variables the setup script serves with, on every core this process may use (as
    radixserve's worker and llama-server take them); Intel's OpenMP preloaded, as vLLM's CPU
    build expects; with `isa="avx2"`, those that keep it to AVX2."""
    if isa not in (None, "avx2"):
        raise ValueError(f"vLLM's CPU build can be held to avx2 only, not {isa}")
    return {
        **(AVX2_ENV if isa == "avx2" else {}),
        "VLLM_CPU_KVCACHE_SPACE": str(KVCACHE_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
        "LD_PRELOAD": str(venv / "lib" / "libiomp5.so"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
    }


class VllmServer(ServerProcess):
    """`with VllmServer(venv, model) as server:` serves the model folder on a free port until
    the block ends; `server.base_url`, `server.reset_prefix_cache()`."""

    name = "vllm-cpu"
    start_timeout_s = 600.0
    stop_timeout_s = 30.0
    poll_interval_s = 1.0

    def __init__(
        self,
        venv: Path,
        model: Path,
        extra_flags: list[str] | None = None,
        isa: str | None = None,
    ):
        if reason := missing(venv, model):
            raise FileNotFoundError(reason)
        (port,) = free_ports(1)
        # `env` sets the server's variables and execs it: the pid stays the server's.
        argv = [
            "env",
            *(f"{name}={value}" for name, value in server_env(venv, isa).items()),
            str(venv / "bin" / "vllm-shim"),
            "serve",
            str(model),
            *FLAGS,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *(extra_flags or []),
        ]
        log_path = Path(tempfile.mkdtemp(prefix="vllm-cpu-bench-")) / "server.log"
        super().__init__(argv, f"http://127.0.0.1:{port}", log_path)

    def reset_prefix_cache(self) -> None:
        """Drops every cached prefix. vLLM answers `success: false` while blocks are still
        held (requests of a failed cell finishing), so it is retried for a while."""
        deadline = time.monotonic() + RESET_TIMEOUT_S
        url = f"{self.base_url}/reset_prefix_cache"
        while True:
            response = httpx2.post(url, timeout=30.0, trust_env=False)
            response.raise_for_status()
            if response.json().get("success"):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} kept answering success: false")
            time.sleep(1.0)

    def kernel_libraries(self) -> set[str]:
        """The vLLM kernel libraries (`_C`, `_C_AVX512`, `_C_AVX2`) mapped by the server's
        processes (it and every descendant: the engine core and its worker)."""
        assert self.proc is not None, "the server runs inside its with block"
        found: set[str] = set()
        pids = [self.proc.pid]
        while pids:
            pid = pids.pop()
            try:
                found |= set(KERNEL_LIBRARY.findall(Path(f"/proc/{pid}/maps").read_text()))
                for task in Path(f"/proc/{pid}/task").iterdir():
                    pids += map(int, (task / "children").read_text().split())
            except OSError:  # the process ended meanwhile
                continue
        return found
