"""The three services (`python -m services.<role>`) as real processes on free ports, with
their logs in one folder: what the service tests, the observability tests and the soak run
against."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import openai

from testing.net import free_port, free_ports, http_status, wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]
ROLES = ("worker", "detokenizer", "tokenizer")
"""The three services, in the order a server starts them."""
SERVER_PORTS = (
    "port",
    "worker-port",
    "detokenizer-port",
    "tokenizer-port",
    "tokenizer-control-port",
    "worker-metrics-port",
    "detokenizer-metrics-port",
)
"""The port flags (without `--`) of one server's three processes."""
HEARTBEAT_INTERVAL = 0.2
"""Fast heartbeats, so that a test sees liveness without waiting seconds."""
SERVING_LINE = re.compile(r"radixserve: serving .* at (\S+)")
"""What `radixserve serve` prints once /health answers; group 1 is the OpenAI base URL."""


def start_serve(flags: list[str], stderr_path: Path) -> subprocess.Popen[str]:
    """`radixserve serve <flags>` from the repository root, its children's logs into
    `stderr_path`; its stdout (the children's pids, then `SERVING_LINE`) is piped."""
    script = shutil.which("radixserve") or str(Path(sys.executable).parent / "radixserve")
    with open(stderr_path, "wb") as stderr:
        return subprocess.Popen(
            [script, "serve", *flags],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def serving_url(serve: subprocess.Popen[str], stderr_path: Path) -> str:
    """The OpenAI base URL that `serve` (from `start_serve`) prints once its own server is
    ready; an assertion error with its children's log if it exits first."""
    assert serve.stdout is not None
    for line in serve.stdout:
        if match := SERVING_LINE.match(line):
            return match[1]
    log = stderr_path.read_text(errors="replace")[-6000:]
    raise AssertionError(f"radixserve serve exited ({serve.wait()}) before serving:\n{log}")


@contextmanager
def serving(flags: list[str], log: Path) -> Iterator[openai.OpenAI]:
    """A client of `radixserve serve <flags>` on a free port, stopped (exit 0) at the end."""
    serve = start_serve([*flags, "--host", "127.0.0.1", "--port", str(free_port())], log)
    try:
        yield openai.OpenAI(base_url=serving_url(serve, log), api_key="none", max_retries=0)
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0


def server_ports() -> dict[str, int]:
    """A distinct free port for each of SERVER_PORTS."""
    return dict(zip(SERVER_PORTS, free_ports(len(SERVER_PORTS))))


def port_flags(ports: Mapping[str, int]) -> list[str]:
    """`--name port` for each of `ports` (as `server_ports` names them)."""
    return [arg for name, port in ports.items() for arg in (f"--{name}", str(port))]


def cpu_flags(max_total_tokens: int, model: str | Path | None = None) -> list[str]:
    """The engine flags of a server on the CPU: float32, a KV pool of `max_total_tokens`, and
    `model` (None: the embedded SmolLM2-135M)."""
    flags = ["--dtype", "float32", "--device", "cpu", "--max-total-tokens", str(max_total_tokens)]
    return flags if model is None else ["--model", str(model), *flags]


class ServiceLauncher:
    """Starts `python -m services.<role>` processes with their logs in `log_dir`, and stops
    whatever is still running at the end.

    `heartbeat_interval` is passed to every process (None: the services' default); `env` is
    added to their environment; `show_logs` prints each log once all are stopped, so that a
    failed test shows what the processes said.
    """

    free_port = staticmethod(free_port)
    """Here too, for fixtures that hold a launcher."""

    def __init__(
        self,
        log_dir: Path,
        heartbeat_interval: float | None = HEARTBEAT_INTERVAL,
        env: Mapping[str, str] | None = None,
        show_logs: bool = True,
    ):
        self.log_dir = log_dir
        self.heartbeat_interval = heartbeat_interval
        self.env = dict(env or {})
        self.show_logs = show_logs
        self.procs: dict[str, subprocess.Popen] = {}

    @contextmanager
    def serve(
        self,
        flags: list[str],
        timeout: float = 120,
        role_flags: Mapping[str, list[str]] | None = None,
        ports: Mapping[str, int] | None = None,
    ) -> Iterator[str]:
        """One server: its three processes on `ports` (default: free ones), each with `flags`
        and its own `role_flags`; yields the base URL once /health answers 200, and stops
        them all after."""
        ports = ports or server_ports()
        flags = [*flags, "--host", "127.0.0.1", *port_flags(ports)]
        for role in ROLES:
            self.start(role, [*flags, *(role_flags or {}).get(role, [])])
        url = f"http://127.0.0.1:{ports['port']}"
        try:
            self.wait_ready(url, timeout)
            yield url
        finally:
            self.stop_all()

    def start(self, role: str, flags: list[str]) -> subprocess.Popen:
        """`python -m services.<role> <flags>` from the repository root, logging to
        `<log_dir>/<role>.log`."""
        heartbeat = (
            []
            if self.heartbeat_interval is None
            else ["--heartbeat-interval", str(self.heartbeat_interval)]
        )
        with open(self.log_dir / f"{role}.log", "wb") as log:
            self.procs[role] = subprocess.Popen(
                [sys.executable, "-m", f"services.{role}", *flags, *heartbeat],
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            )
        return self.procs[role]

    def wait_ready(self, url: str, timeout: float) -> None:
        """Until `url`/health answers 200; a process that exits meanwhile fails at once."""

        def ready() -> bool:
            dead = [role for role, proc in self.procs.items() if proc.poll() is not None]
            assert not dead, f"{', '.join(dead)} exited before {url} was up; logs in {self.log_dir}"
            return http_status(url + "/health") == 200

        wait_until(ready, timeout, f"{url}/health to answer 200")

    def stop(self, role: str, timeout: float = 5.0) -> int | None:
        """SIGTERM, then the exit status, or None (and a kill) if it did not exit in time."""
        proc = self.procs[role]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        return self._reap(proc, timeout)

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM to every process at once, then each one reaped (killed after `timeout`)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            self._reap(proc, timeout)
        if self.show_logs:
            for role in self.procs:
                print(f"----- {role} log -----\n{self.log(role)}")

    def log(self, role: str) -> str:
        return (self.log_dir / f"{role}.log").read_text(errors="replace")

    @staticmethod
    def _reap(proc: subprocess.Popen, timeout: float) -> int | None:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None
