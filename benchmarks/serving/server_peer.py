"""radixserve as a benchmark peer: `radixserve serve` in a subprocess on free ports, so a
run never collides with a server or a test already on the machine. The peer is started the
way a user starts it, through the launcher that supervises the three services, rather than
as the tests' `ServiceLauncher` starts each service on its own."""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2

from benchmarks.serving.metrics import cpu_info
from testing.launcher import port_flags, server_ports
from testing.server_process import ServerProcess

FLUSH_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ServerPeer:
    name: str
    flags: tuple[str, ...]
    """Besides the flags every radixserve peer shares (`compare.COMMON_SERVER_FLAGS`)."""


class RadixServer(ServerProcess):
    """`with RadixServer(flags) as server:` serves until the block ends; `server.base_url`,
    `server.metrics_urls` (the tokenizer's and the worker's /metrics), `server.flush_cache()`.
    Stopping it sends SIGTERM to the launcher, which stops its three children."""

    name = "radixserve"

    def __init__(
        self,
        flags: list[str],
        log_dir: Path | None = None,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ):
        """`cwd`: the checkout whose code serves (another `git worktree`, to compare two
        commits with the same interpreter: `python -m` imports from the working directory
        first). `env`: variables set for this server only, on top of this process's
        (`RADIXSERVE_CPU_ISA=avx2` to run the AVX2 kernel path)."""
        ports = server_ports()
        base_url = f"http://127.0.0.1:{ports['port']}"
        self.metrics_urls = [
            f"{base_url}/metrics",
            f"http://127.0.0.1:{ports['worker-metrics-port']}/metrics",
        ]
        # `env` sets the variables and execs the launcher: the pid stays the launcher's.
        prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
        argv = [
            *prefix,
            sys.executable,
            "-m",
            "services.launch",
            "serve",
            "--host",
            "127.0.0.1",
            *flags,
            *port_flags(ports),
        ]
        log_path = Path(log_dir or tempfile.mkdtemp(prefix="radixserve-bench-")) / "server.log"
        super().__init__(argv, base_url, log_path, cwd)

    def kernel(self) -> dict[str, Any]:
        """What this server runs the model as: the kernel path (`cpu_isa`) and the CPU flags
        it was chosen from, from `/get_server_info`; the dtype, the weights' format and the
        KV cache's dtype as resolved (the `radixserve_cpu_info` gauge on the worker's
        /metrics); and the `--dtype` / `--quantization` settings they were resolved from."""
        info = httpx2.get(f"{self.base_url}/get_server_info", timeout=30.0, trust_env=False)
        info.raise_for_status()
        settings = info.json()
        metrics = httpx2.get(self.metrics_urls[1], timeout=30.0, trust_env=False).text
        resolved = cpu_info(metrics) or {}
        return {
            "cpu_isa": settings.get("cpu_isa"),
            "cpu_flags": settings.get("cpu_flags"),
            "dtype": resolved.get("dtype"),
            "weights": resolved.get("weights"),
            "kv_cache_dtype": resolved.get("kv_cache_dtype"),
            "dtype_setting": settings.get("dtype"),
            "quantization_setting": settings.get("quantization"),
        }

    def flush_cache(self) -> None:
        """Empties the radix tree, so no cell of the matrix inherits the previous one's
        prefixes. The server refuses (409) while requests run: after a failed cell some may
        still be finishing, so it is retried for a while."""
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        url = f"{self.base_url}/flush_cache"
        while (response := httpx2.post(url, timeout=30.0, trust_env=False)).status_code == 409:
            if time.monotonic() > deadline:
                break
            time.sleep(1.0)
        response.raise_for_status()
