"""Real service processes on free ports, and a stand-in for the peers a test plays.

The model is a tiny random-weight Llama with the SmolLM2 vocabulary, saved next to the
embedded model's tokenizer, so the processes load in seconds and decode real text.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest
import zmq
from transformers import PreTrainedTokenizerBase

from benchmarks.soak import build_tiny_model
from engine.model.loader import load_tokenizer
from services.ipc import Receiver, Sender, bind_pull, bound_port, connect_push
from services.protocol import BatchStrOutput, Heartbeat, Hello, Message, new_epoch

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_CONTEXT_LENGTH = 8192
"""Longer than the tests' --max-total-tokens, so a request can fit the context but never the pool."""
HEARTBEAT_INTERVAL = 0.2
"""Fast heartbeats in tests, so liveness is seen without waiting seconds."""
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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights, scaled up so greedy choices are clear-cut rather than near-ties."""
    path = tmp_path_factory.mktemp("tiny-llama-smollm2-vocab")
    build_tiny_model(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_llama_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(str(tiny_llama_dir))


def wait_until(
    condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.1
) -> Any:
    """Poll `condition` until it is truthy (its value is returned) or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(interval)
    return result


def http_status(url: str) -> int | None:
    """The status of a GET, or None while nothing answers."""
    try:
        return httpx2.get(url, timeout=2).status_code
    except httpx2.TransportError:
        return None


class ServiceLauncher:
    """Starts `python -m services.<role>` processes with their logs in one folder, and stops
    whatever is still running at teardown."""

    def __init__(self, log_dir: Path, heartbeat_interval: float = HEARTBEAT_INTERVAL):
        self.log_dir = log_dir
        self.heartbeat_interval = heartbeat_interval
        self.procs: dict[str, subprocess.Popen] = {}

    @staticmethod
    def free_port() -> int:
        """A port free right now (the OS does not hand it out again at once)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def server_ports(self) -> dict[str, int]:
        """A free port for each of SERVER_PORTS."""
        return {name: self.free_port() for name in SERVER_PORTS}

    @staticmethod
    def port_flags(ports: dict[str, int]) -> list[str]:
        return [arg for name, port in ports.items() for arg in (f"--{name}", str(port))]

    @contextmanager
    def serve(
        self, flags: list[str], timeout: float = 120, role_flags: dict[str, list[str]] | None = None
    ) -> Iterator[str]:
        """One server, its three processes on free ports (`role_flags` adds a role's own
        flags); yields its base URL once /health answers 200 and stops them all after."""
        ports = self.server_ports()
        flags = [*flags, "--host", "127.0.0.1", *self.port_flags(ports)]
        for role in ("worker", "detokenizer", "tokenizer"):
            self.start(role, [*flags, *(role_flags or {}).get(role, [])])
        url = f"http://127.0.0.1:{ports['port']}"
        try:
            wait_until(lambda: http_status(url + "/health") == 200, timeout, "/health 200")
            yield url
        finally:
            self.stop_all()

    def start(self, role: str, flags: list[str]) -> subprocess.Popen:
        with open(self.log_dir / f"{role}.log", "wb") as log:
            self.procs[role] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    f"services.{role}",
                    *flags,
                    "--heartbeat-interval",
                    str(self.heartbeat_interval),
                ],
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        return self.procs[role]

    def stop(self, role: str, timeout: float = 5.0) -> int | None:
        """SIGTERM, then the exit status, or None (and a kill) if it did not exit in time."""
        proc = self.procs[role]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None

    def stop_all(self) -> None:
        for role in self.procs:
            self.stop(role)
            print(f"----- {role} log -----\n{(self.log_dir / f'{role}.log').read_text()}")


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceLauncher]:
    launcher = ServiceLauncher(tmp_path_factory.mktemp("service-logs"))
    yield launcher
    launcher.stop_all()


@dataclass
class Stream:
    """One rid's outputs, accumulated over BatchStrOutputs as the tokenizer would."""

    ids: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)
    messages: int = 0
    finished_reason: object = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None


class PeerStub:
    """Plays the processes around the one under test: pushes to `push_port` as `role`, and
    pulls on its own ports what the tokenizer would receive (outputs and control)."""

    def __init__(self, role: str, push_port: int):
        self.ctx = zmq.Context()
        out_sock, control_sock = bind_pull(self.ctx, 0), bind_pull(self.ctx, 0)
        self.output_port, self.control_port = bound_port(out_sock), bound_port(control_sock)
        self.outputs = Receiver(out_sock, "test-outputs")
        self.control = Receiver(control_sock, "test-control")
        self.sender = Sender(
            connect_push(self.ctx, push_port), role, new_epoch(), HEARTBEAT_INTERVAL
        )
        self.raw = connect_push(self.ctx, push_port)
        self.streams: dict[str, Stream] = {}
        self.batches: list[BatchStrOutput] = []
        self.replies: list[Message] = []
        self.alive_signs: list[Hello | Heartbeat] = []

    def send(self, msg: Message, timeout: float = 10.0) -> None:
        """Send once the PUSH socket is connected (IMMEDIATE refuses sends before that)."""
        deadline = time.monotonic() + timeout
        while not self.sender.send(msg):
            assert time.monotonic() < deadline, (
                f"could not send {type(msg).__name__}: peer not connected"
            )
            time.sleep(0.01)

    def pump(self, timeout_ms: int = 50) -> None:
        """Take in whatever arrived on both sockets, and keep the peer under test seeing
        this stub alive."""
        self.sender.heartbeat_if_due()
        for msg in self.control.recv_all(timeout_ms) + self.outputs.recv_all(0):
            if isinstance(msg, (Hello, Heartbeat)):
                self.alive_signs.append(msg)
            elif isinstance(msg, BatchStrOutput):
                self.batches.append(msg)
                self._accumulate(msg)
            else:
                self.replies.append(msg)

    def wait_for(
        self, condition: Callable[[], object], timeout: float = 30.0, what: str = "condition"
    ) -> object:
        deadline = time.monotonic() + timeout
        while True:
            result = condition()
            if result:
                return result
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.pump()

    def reply(self, kind: type, rid: str = "", timeout: float = 30.0) -> Message:
        """The first unconsumed control reply of `kind` (with `rid`, when it has one)."""

        def find() -> Message | None:
            for msg in self.replies:
                if isinstance(msg, kind) and getattr(msg, "rid", rid) == rid:
                    self.replies.remove(msg)
                    return msg
            return None

        return self.wait_for(find, timeout, kind.__name__)

    def first_output(self, rid: str, timeout: float = 30.0) -> Stream:
        return self.wait_for(lambda: self.streams.get(rid), timeout, f"a first output of {rid}")

    def result(self, rid: str, timeout: float = 30.0) -> Stream:
        def finished() -> Stream | None:
            stream = self.streams.get(rid)
            return stream if stream is not None and stream.finished else None

        return self.wait_for(finished, timeout, f"{rid} to finish")

    def send_raw(self, data: bytes, timeout: float = 10.0) -> None:
        """Bytes that bypass the protocol, as a buggy or hostile local process would send."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.raw.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                assert time.monotonic() < deadline, "raw socket never connected"
                time.sleep(0.01)

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def _accumulate(self, batch: BatchStrOutput) -> None:
        for i, rid in enumerate(batch.rids):
            stream = self.streams.setdefault(rid, Stream())
            stream.ids += batch.output_ids[i]
            stream.deltas.append(batch.output_strs[i])
            stream.messages += 1
            stream.finished_reason = batch.finished_reasons[i]
            stream.prompt_tokens = batch.prompt_tokens[i]
            stream.completion_tokens = batch.completion_tokens[i]
            stream.cached_tokens = batch.cached_tokens[i]
            if batch.output_token_logprobs_val is not None:
                stream.logprobs += batch.output_token_logprobs_val[i]


@pytest.fixture(scope="module")
def make_stub() -> Iterator[Callable[[str, int], PeerStub]]:
    """`make_stub(role, push_port)`: a PeerStub closed at teardown."""
    stubs: list[PeerStub] = []

    def make(role: str, push_port: int) -> PeerStub:
        stubs.append(PeerStub(role, push_port))
        return stubs[-1]

    yield make
    for stub in stubs:
        stub.close()
