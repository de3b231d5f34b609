"""llama.cpp's `llama-server` as a benchmark peer: the CPU server a user would pick instead of
radixserve, serving the same embedded GGUF (SmolLM2-135M-Instruct, Q4_1) through its
OpenAI-compatible `/v1/completions` (token-id prompts, `ignore_eos`, streamed with usage).
Build it with `../shared/tools/build-llama-server.sh` (or any llama.cpp build).

It has no `/flush_cache`: its slots keep their prompts' KV for reuse, so each cell runs in
a fresh server, as each radixserve cell runs after a flush.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from benchmarks.support.net import free_ports, http_status

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
DEFAULT_FLAGS = ("-c", "32768", "-np", "16", "--no-repack", "--no-webui")
"""16 slots sharing a 32k context (2k per slot: the longest workload prompt plus its
output fits); `--no-repack`: on CPUs with AMX the native build crashes in its AMX Q4_1
path on the first decode (../shared/tools/build-llama-server.sh)."""


def default_binary() -> Path:
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    return tmp / "radixserve-llama-server" / "llama-server"


def thread_flags() -> list[str]:
    """Generation and batch threads: every core, as radixserve's worker takes them."""
    threads = str(len(os.sched_getaffinity(0)))
    return ["-t", threads, "-tb", threads]


class LlamaServer:
    """`with LlamaServer(binary) as server:` serves the embedded GGUF on a free port until the
    block ends; `server.base_url`."""

    def __init__(self, binary: Path, extra_flags: list[str] | None = None):
        from engine.model.embedded import embedded_model_path

        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(
                f"no llama-server at {binary}; build it with "
                "../shared/tools/build-llama-server.sh or pass --llama-server PATH"
            )
        (port,) = free_ports(1)
        self.base_url = f"http://127.0.0.1:{port}"
        self.argv = [
            str(binary),
            "-m",
            str(embedded_model_path()),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *DEFAULT_FLAGS,
            *thread_flags(),
            *(extra_flags or []),
        ]
        self.log_path = Path(tempfile.mkdtemp(prefix="llama-server-bench-")) / "server.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while http_status(f"{self.base_url}/health", timeout=2.0) != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"llama-server did not become healthy; {self.log_path}:\n{tail}")
            time.sleep(0.25)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
