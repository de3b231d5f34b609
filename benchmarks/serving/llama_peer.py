"""llama.cpp's `llama-server` as a benchmark peer: the CPU server a user would pick instead of
radixserve, serving the same embedded GGUF (SmolLM2-135M-Instruct, Q4_1) through its
OpenAI-compatible `/v1/completions` (token-id prompts, `ignore_eos`, streamed with usage).
Build it with `../shared/tools/build-llama-server.sh` (or any llama.cpp build); for the
AVX2-only build an AVX2-only CPU would get, `benchmarks/serving/build-llama-server-avx2.sh`.

It has no `/flush_cache`: its slots keep their prompts' KV for reuse, so each cell runs in
a fresh server, as each radixserve cell runs after a flush.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from testing.net import free_ports
from testing.server_process import ServerProcess

DEFAULT_FLAGS = ("-c", "32768", "-np", "16", "--no-repack", "--no-webui")
"""16 slots sharing a 32k context (2k per slot: the longest workload prompt plus its
output fits); `--no-repack`: on CPUs with AMX the native build crashes in its AMX Q4_1
path on the first decode (../shared/tools/build-llama-server.sh)."""


def default_binary(build: str = "") -> Path:
    """Where ../shared/tools/build-llama-server.sh puts its native build, or with `build`
    ("avx2") where build-llama-server-avx2.sh puts its build."""
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    return tmp / "-".join(["radixserve-llama-server", *filter(None, [build])]) / "llama-server"


def thread_flags() -> list[str]:
    """Generation and batch threads: every core, as radixserve's worker takes them."""
    threads = str(len(os.sched_getaffinity(0)))
    return ["-t", threads, "-tb", threads]


class LlamaServer(ServerProcess):
    """`with LlamaServer(binary) as server:` serves an embedded GGUF (`model`: `embedded` or
    `gemma3-270m`) on a free port until the block ends; `server.base_url`."""

    name = "llama-server"
    start_timeout_s = 120.0
    stop_timeout_s = 15.0
    poll_interval_s = 0.25

    def __init__(self, binary: Path, model: str = "embedded", extra_flags: list[str] | None = None):
        from engine.model.embedded import embedded_model_path

        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(
                f"no llama-server at {binary}; build it with "
                "../shared/tools/build-llama-server.sh or pass --llama-server PATH"
            )
        (port,) = free_ports(1)
        argv = [
            str(binary),
            "-m",
            str(embedded_model_path(model)),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *DEFAULT_FLAGS,
            *thread_flags(),
            *(extra_flags or []),
        ]
        log_path = Path(tempfile.mkdtemp(prefix="llama-server-bench-")) / "server.log"
        super().__init__(argv, f"http://127.0.0.1:{port}", log_path)
