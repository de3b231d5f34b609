"""radixserve as a benchmark peer: `radixserve serve` in a subprocess on free ports, so a
run never collides with a server or a test already on the machine. The peer is started the
way a user starts it, through the launcher that supervises the three services, rather than
as the tests' `ServiceLauncher` starts each service on its own."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx2

from benchmarks.support.launcher import port_flags, server_ports
from benchmarks.support.net import http_status

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
FLUSH_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ServerPeer:
    name: str
    flags: tuple[str, ...]
    """Besides --model and --dtype, which every radixserve peer shares."""


class RadixServer:
    """`with RadixServer(flags) as server:` serves until the block ends; `server.base_url`,
    `server.metrics_urls` (the tokenizer's and the worker's /metrics), `server.flush_cache()`."""

    def __init__(self, flags: list[str], log_dir: Path | None = None, cwd: Path | None = None):
        """`cwd`: the checkout whose code serves (another `git worktree`, to compare two
        commits with the same interpreter: `python -m` imports from the working directory
        first)."""
        self.cwd = cwd
        ports = server_ports()
        self.base_url = f"http://127.0.0.1:{ports['port']}"
        self.metrics_urls = [
            f"{self.base_url}/metrics",
            f"http://127.0.0.1:{ports['worker-metrics-port']}/metrics",
        ]
        self.argv = [
            sys.executable,
            "-m",
            "services.launch",
            "serve",
            "--host",
            "127.0.0.1",
            *flags,
            *port_flags(ports),
        ]
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="radixserve-bench-")) / "server.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> RadixServer:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while http_status(f"{self.base_url}/health", timeout=2.0) != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"radixserve did not become healthy; log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

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

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the launcher, which stops its three children."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
