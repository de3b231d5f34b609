"""The `radixserve` command line; `radixserve serve` runs the three processes on one host.

`serve` validates the settings once, then starts `python -m services.worker|detokenizer|
tokenizer` with the same flags (and the same RADIXSERVE_* environment), so all three
agree. The group lives and dies together: a child that exits takes the others down and
the launcher exits non-zero, as a pod would restart.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from importlib.metadata import version

ROLES = ("worker", "detokenizer", "tokenizer")
"""Start order: the worker loads the model, the slowest step, so it starts first."""
POLL_INTERVAL_S = 0.2
STOP_TIMEOUT_S = 5.0
"""How long a child gets to exit after SIGTERM before it is killed."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="radixserve", description="An SGLang-style LLM serving engine."
    )
    parser.add_argument(
        "--version", action="version", version=f"radixserve {version('radixserve')}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("radix-demo", help="print a small simulated radix tree (no model needed)")
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
    elif args.command == "serve":
        sys.exit(serve(rest))


def serve(argv: list[str]) -> int:
    """Run the three processes until a signal (exit 0) or until one of them exits (exit 1)."""
    from services.settings import Settings

    settings = Settings.from_cli(argv, prog="radixserve serve")
    children = ServiceGroup(argv)
    stop_signal: list[int] = []

    def on_signal(signum: int, frame: types.FrameType | None) -> None:
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
        children.stop()


class ServiceGroup:
    """The three child processes. Each runs in its own session, so a terminal's Ctrl-C
    reaches them once, through the launcher, rather than twice."""

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        for role in ROLES:
            proc = subprocess.Popen(
                [sys.executable, "-m", f"services.{role}", *self.argv], start_new_session=True
            )
            self.procs[role] = proc
            print(f"radixserve: started {role} (pid {proc.pid})", flush=True)

    def first_exited(self) -> tuple[str, int] | None:
        for role, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return role, code
        return None

    def stop(self) -> None:
        """SIGTERM to all at once, then a kill for any still running after STOP_TIMEOUT_S."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs.values():
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
