"""The `radixserve` command line; `radixserve serve` runs the three processes on one host.

`serve` validates the settings once, refuses a model, draft model or LoRA adapter it cannot
serve and a port it was given that is taken (one line each, naming what it found, before
anything starts; the traceback too under `--log-level debug`), then starts `python -m
services.worker|detokenizer|tokenizer` with the same flags (and the same RADIXSERVE_*
environment), so all three agree. Whatever could collide with another server on the same
host it makes private to this run, in a runtime directory (0700) removed at exit: the ZMQ
sockets not given a port are ipc:// sockets there, as SGLang and vLLM do; fresh wire keys
unless `--ipc-keys-dir`; free metrics ports unless given. It reports "serving" once
`/health` answers 200 with its own launch id (`--launch-id`), not some other server on the
port. The group lives and dies together: a child that exits takes the others down and the
launcher exits non-zero, as a pod would restart. SIGTERM drains: the tokenizer stops
accepting and finishes its requests (`--graceful-shutdown-timeout`) while the worker and
detokenizer still serve them; only then are those two stopped.
`radixserve keys DIR` makes a keys directory (the chart's init container runs it).
"""

from __future__ import annotations

import argparse
import errno
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import urllib.error
import urllib.request
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.settings import Settings

ROLES = ("worker", "detokenizer", "tokenizer")
"""Start order: the worker loads the model, the slowest step, so it starts first."""
POLL_INTERVAL_S = 0.2
STOP_TIMEOUT_S = 5.0
"""How long a child gets to exit after SIGTERM (past its drain) before it is killed."""
DRAIN_FIRST = ("tokenizer",)
"""Stopped first, and waited for: the process that holds the clients' connections."""
METRICS_PORTS = ("worker_metrics_port", "detokenizer_metrics_port")
"""The HTTP ports of the worker and the detokenizer: free ones are chosen when unset."""
PROBE_TIMEOUT_S = 2.0
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""The readiness probe goes to this host, never through an HTTP proxy of the environment."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="radixserve", description="An SGLang-style LLM serving engine."
    )
    parser.add_argument(
        "--version", action="version", version=f"radixserve {version('radixserve')}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("radix-demo", help="print a small simulated radix tree (no model needed)")
    keys = commands.add_parser(
        "keys", help="make the CURVE keys of the ZMQ wire (--ipc-keys-dir) in a directory"
    )
    keys.add_argument(
        "directory", help="made if absent, private to this user; keys already there are kept"
    )
    # The serve flags are the Settings flags; `radixserve serve --help` lists them.
    commands.add_parser(
        "serve", help="serve the OpenAI-compatible API (all three processes)", add_help=False
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "radix-demo":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from engine.cache.demo import demo

        demo()
    elif args.command == "keys":
        from services.ipc import create_wire_keys

        print(f"radixserve: wire keys in {create_wire_keys(args.directory)}")
    elif args.command == "serve":
        sys.exit(serve(rest))


def serve(argv: list[str]) -> int:
    """Run the three processes until a signal (exit 0) or until one of them exits (exit 1);
    exit 1 at once, with one line, when a port it was given is taken (or exit 2 when
    RADIXSERVE_CPU_ISA asks for more than this CPU has, or the model files are refused)."""
    from engine.kernels.cpu.isa import apply_forced_isa

    # First, before anything loads torch: ATen and oneDNN fix their instruction set at their
    # first dispatch, and the three processes inherit the caps from this environment.
    try:
        apply_forced_isa()
    except ValueError as e:
        print(f"radixserve serve: error: {e}", file=sys.stderr)
        return 2
    from services.preflight import exit_if_refused
    from services.settings import Settings
    from services.tokenizer.worker_metrics_proxy import loopback_host

    settings = Settings.from_cli(argv, prog="radixserve serve")
    if settings.node_rank > 0:
        print(
            "radixserve: serve runs node 0 (the API and rank 0); on node K > 0 run "
            "`python -m services.worker --node-rank K` with the same flags",
            file=sys.stderr,
        )
        return 2
    exit_if_refused(settings, "radixserve serve")
    problem = taken_port(settings)
    if problem is not None:
        print(f"radixserve serve: error: {problem}", file=sys.stderr)
        return 1
    started = time.monotonic()
    runtime_dir = tempfile.mkdtemp(prefix="radixserve-")
    launch_id = settings.launch_id or secrets.token_hex(8)
    children = ServiceGroup(argv, child_environment(settings, runtime_dir, launch_id))
    stop_signal: list[int] = []

    def on_signal(signum: int, frame: types.FrameType | None) -> None:
        if stop_signal:  # a second Ctrl-C: the tokenizer (uvicorn) stops draining
            children.interrupt(signum)
        stop_signal.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    host = loopback_host(settings.host)
    base_url = f"http://{f'[{host}]' if ':' in host else host}:{settings.port}"
    ready = False
    try:
        children.start()
        while not stop_signal:
            dead = children.first_exited()
            if dead is not None:
                role, code = dead
                print(
                    f"radixserve: the {role} process exited with status {code}; "
                    "stopping the others",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            if not ready and _answers_as(base_url, launch_id):
                ready = True
                print(
                    f"radixserve: serving {settings.model_id} at {base_url}/v1 "
                    f"(ready in {time.monotonic() - started:.1f} s)",
                    flush=True,
                )
            time.sleep(POLL_INTERVAL_S)
        print(
            f"radixserve: received {signal.Signals(stop_signal[0]).name}; stopping",
            file=sys.stderr,
            flush=True,
        )
        return 0
    finally:
        children.stop(settings.graceful_shutdown_timeout)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def taken_port(settings: Settings) -> str | None:
    """One line naming the first port given to this server (`--port`, and any other port
    flag set) that cannot be bound, and its flag; None when all can. Bound as the servers
    will bind them: ZMQ on 127.0.0.1, HTTP on --host, with SO_REUSEADDR (so only a port
    another socket listens on fails, not one a previous run left in TIME_WAIT)."""
    from services.settings import PORT_FIELDS, ZMQ_PORT_ROLES

    for name in PORT_FIELDS:
        port = getattr(settings, name)
        if port is None:
            continue
        host = "127.0.0.1" if name in ZMQ_PORT_ROLES else settings.host
        flag = "--" + name.replace("_", "-")
        try:
            with _bound(host, port):
                pass
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (
                    f"port {port} ({flag}) is already in use on {host}: stop what holds it, "
                    f"or pick another {flag}"
                )
            return f"cannot bind port {port} ({flag}) on {host}: {e.strerror or e}"
    return None


def child_environment(settings: Settings, runtime_dir: str, launch_id: str) -> dict[str, str]:
    """The RADIXSERVE_* variables `serve` adds for its children (below any flag): the launch
    id, and for what the settings leave unset, private to this run: wire keys and the ipc://
    sockets in `runtime_dir`, and free metrics ports (on --host, where they will be bound)."""
    from services.ipc import create_wire_keys
    from services.settings import ENV_PREFIX, ZMQ_PORT_ROLES

    values: dict[str, str] = {"launch_id": launch_id}
    if settings.ipc_keys_dir is None:
        values["ipc_keys_dir"] = str(create_wire_keys(Path(runtime_dir) / "keys"))
    if settings.ipc_dir is None and any(getattr(settings, n) is None for n in ZMQ_PORT_ROLES):
        values["ipc_dir"] = runtime_dir
    unset = [name for name in METRICS_PORTS if getattr(settings, name) is None]
    for name, port in zip(unset, _free_ports(settings.host, len(unset)), strict=True):
        values[name] = str(port)
    return {ENV_PREFIX + name.upper(): value for name, value in values.items()}


def _bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (`host`, `port`), as a server would bind it (not listening)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _free_ports(host: str, n: int) -> list[int]:
    """`n` distinct ports free on `host` now: each socket stays bound until all are chosen."""
    sockets = [_bound(host, 0) for _ in range(n)]
    try:
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class ServiceGroup:
    """The three child processes, with `argv` and this environment plus `env`. Each runs in
    its own session, so a terminal's Ctrl-C reaches them once, through the launcher, rather
    than twice."""

    def __init__(self, argv: list[str], env: Mapping[str, str] | None = None):
        self.argv = argv
        self.env = {**os.environ, **(env or {})}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        for role in ROLES:
            proc = subprocess.Popen(
                [sys.executable, "-m", f"services.{role}", *self.argv],
                start_new_session=True,
                env=self.env,
            )
            self.procs[role] = proc
            print(f"radixserve: started {role} (pid {proc.pid})", flush=True)

    def first_exited(self) -> tuple[str, int] | None:
        for role, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return role, code
        return None

    def stop(self, drain_timeout: float) -> None:
        """The tokenizer first: it refuses new connections and lets its requests finish for
        up to `drain_timeout` (its --graceful-shutdown-timeout), which needs the worker and
        the detokenizer; then those two. Each is killed if still running STOP_TIMEOUT_S
        after its deadline."""
        self._terminate(DRAIN_FIRST, drain_timeout + STOP_TIMEOUT_S)
        self._terminate(tuple(r for r in ROLES if r not in DRAIN_FIRST), STOP_TIMEOUT_S)

    def interrupt(self, signum: int) -> None:
        """Pass a repeated signal on to the processes that are draining."""
        for role in DRAIN_FIRST:
            proc = self.procs.get(role)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signum)

    def _terminate(self, roles: tuple[str, ...], timeout: float) -> None:
        """SIGTERM to `roles` at once, then a kill for any still running after `timeout`."""
        procs = [self.procs[role] for role in roles if role in self.procs]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _answers_as(base_url: str, launch_id: str) -> bool:
    """`/health` answers 200 with `launch_id`: this run's tokenizer is up and ready, not
    another server that holds the port."""
    from services.settings import LAUNCH_ID_HEADER

    try:
        with _NO_PROXY.open(f"{base_url}/health", timeout=PROBE_TIMEOUT_S) as response:
            return bool(
                response.status == 200 and response.headers.get(LAUNCH_ID_HEADER) == launch_id
            )
    except (urllib.error.URLError, OSError):
        return False


if __name__ == "__main__":
    main()
