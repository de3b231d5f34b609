"""A benchmark peer's server as a subprocess: started, waited for until `/health` answers
200, and stopped with SIGTERM (then SIGKILL) when the `with` block ends."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from testing.net import http_status


class ServerProcess:
    """Subclasses set `name`, the timeouts, and call `__init__` with the command line."""

    name = "server"
    start_timeout_s = 300.0
    stop_timeout_s = 30.0
    poll_interval_s = 0.5

    def __init__(self, argv: list[str], base_url: str, log_path: Path, cwd: Path | None = None):
        self.argv = argv
        self.base_url = base_url
        self.log_path = log_path
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd
            )
        deadline = time.monotonic() + self.start_timeout_s
        while http_status(f"{self.base_url}/health", timeout=2.0) != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{self.name} did not become healthy; log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(self.poll_interval_s)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
