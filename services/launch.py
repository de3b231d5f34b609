"""The `radixserve` command line; `radixserve serve` runs the three processes on one host.

`serve` validates the settings once, then starts `python -m services.worker|detokenizer|
tokenizer` with the same flags (and the same RADIXSERVE_* environment), so all three
agree. Without `--ipc-keys-dir` it makes a private directory of fresh wire keys for them,
removed at exit. The group lives and dies together: a child that exits takes the others
down and the launcher exits non-zero, as a pod would restart. SIGTERM drains: the
tokenizer stops accepting and finishes its requests (`--graceful-shutdown-timeout`) while
the worker and detokenizer still serve them; only then are those two stopped.
`radixserve keys DIR` makes a keys directory (the chart's init container runs it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import urllib.error
import urllib.request
from importlib.metadata import version

ROLES = ("worker", "detokenizer", "tokenizer")
"""Start order: the worker loads the model, the slowest step, so it starts first."""
POLL_INTERVAL_S = 0.2
STOP_TIMEOUT_S = 5.0
"""How long a child gets to exit after SIGTERM (past its drain) before it is killed."""
DRAIN_FIRST = ("tokenizer",)
"""Stopped first, and waited for: the process that holds the clients' connections."""
KEYS_ENV = "RADIXSERVE_IPC_KEYS_DIR"


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
    """Run the three processes until a signal (exit 0) or until one of them exits (exit 1)."""
    from services.settings import Settings

    settings = Settings.from_cli(argv, prog="radixserve serve")
    if settings.node_rank > 0:
        print(
            "radixserve: serve runs node 0 (the API and rank 0); on node K > 0 run "
            "`python -m services.worker --node-rank K` with the same flags",
            file=sys.stderr,
        )
        return 2
    keys_dir = None if settings.ipc_keys_dir else _make_wire_keys()
    children = ServiceGroup(argv, keys_dir)
    stop_signal: list[int] = []

    def on_signal(signum: int, frame: types.FrameType | None) -> None:
        if stop_signal:  # a second Ctrl-C: the tokenizer (uvicorn) stops draining
            children.interrupt(signum)
        stop_signal.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    children.start()
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    base_url = f"http://{host}:{settings.port}"
    ready = False
    try:
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
            if not ready and _is_ready(base_url):
                ready = True
                print(
                    f"radixserve: serving {settings.served_model_name} at {base_url}/v1", flush=True
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
        if keys_dir is not None:
            shutil.rmtree(keys_dir, ignore_errors=True)


def _make_wire_keys() -> str:
    """A fresh private (0700) directory of wire keys for this run's three processes."""
    from services.ipc import create_wire_keys

    return str(create_wire_keys(tempfile.mkdtemp(prefix="radixserve-keys-")))


class ServiceGroup:
    """The three child processes. Each runs in its own session, so a terminal's Ctrl-C
    reaches them once, through the launcher, rather than twice. `keys_dir`, when given,
    reaches them as RADIXSERVE_IPC_KEYS_DIR."""

    def __init__(self, argv: list[str], keys_dir: str | None = None):
        self.argv = argv
        self.env = {**os.environ, **({KEYS_ENV: keys_dir} if keys_dir else {})}
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


def _is_ready(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


if __name__ == "__main__":
    main()
