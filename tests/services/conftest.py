"""Real service processes on free ports (`launcher`), and a stand-in for the peers a test
plays (`make_stub`). The processes serve the tiny Llama with the SmolLM2 vocabulary
(`tiny_llama_dir`), so they load in seconds and decode real text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2
import pytest
import zmq

from services.io_struct import BatchStrOutput, Heartbeat, Hello, Message, new_epoch
from services.ipc import Receiver, Sender, bind_pull, bound_port, connect_push, create_wire_keys
from testing.launcher import HEARTBEAT_INTERVAL, ServiceLauncher, cpu_flags, server_ports
from testing.net import free_ports

if TYPE_CHECKING:
    from engine.api import Engine


@pytest.fixture(scope="session")
def wire_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A keys directory (`radixserve keys`) that the session's keyed servers share."""
    return create_wire_keys(tmp_path_factory.mktemp("wire") / "keys")


def keys_env(keys_dir: Path) -> dict[str, str]:
    """The environment that gives a launcher's processes the wire keys in `keys_dir`."""
    return {"RADIXSERVE_IPC_KEYS_DIR": str(keys_dir)}


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceLauncher]:
    launcher = ServiceLauncher(tmp_path_factory.mktemp("service-logs"))
    yield launcher
    launcher.stop_all()


OFFLINE_MAX_TOTAL_TOKENS = 4096


@pytest.fixture(scope="session")
def offline(tiny_llama_dir: Path) -> Iterator[Engine]:
    """The offline Engine on the tiny Llama, as the tiny servers run it (`cpu_flags`), that
    their greedy answers and prompt logprobs are checked against."""
    from engine.api import Engine

    with Engine(
        str(tiny_llama_dir),
        dtype="float32",
        device="cpu",
        max_total_tokens=OFFLINE_MAX_TOTAL_TOKENS,
    ) as engine:
        yield engine


ROUTER_FACING_MAX_RUNNING = 2
"""The router-facing server's running batch: a few requests make a queue."""


@dataclass
class RouterFacingServer:
    """One real server as a router sees it, shared by the tests of what routers read (the
    API port's metrics, the render endpoints, the KV-cache events): it publishes KV events
    on 127.0.0.1 with a replay socket, and runs at most two requests at once."""

    url: str
    model: str
    ports: dict[str, int]
    events_endpoint: str
    replay_endpoint: str

    def metrics(self, flag: str = "port") -> str:
        """The `/metrics` text of the port set by `--<flag>`."""
        response = httpx2.get(f"http://127.0.0.1:{self.ports[flag]}/metrics", timeout=10)
        assert response.status_code == 200, response.text
        return response.text


@pytest.fixture(scope="session")
def router_facing_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, wire_keys: Path
) -> Iterator[RouterFacingServer]:
    events, replay = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
    config = {"publisher": "zmq", "endpoint": events, "replay_endpoint": replay, "topic": "kv@rs"}
    flags = [
        *cpu_flags(4096, tiny_llama_dir),
        "--max-running-requests",
        str(ROUTER_FACING_MAX_RUNNING),
        "--kv-events-config",
        json.dumps(config),
    ]
    ports = server_ports()
    launcher = ServiceLauncher(
        tmp_path_factory.mktemp("router-facing-logs"), env=keys_env(wire_keys)
    )
    with launcher.serve(flags, ports=ports) as url:
        model = httpx2.get(f"{url}/v1/models").json()["data"][0]["id"]
        yield RouterFacingServer(url, model, ports, events, replay)


EMBEDDED_WORKER_MAX_DEPTH = 64
EMBEDDED_TOKENIZER_MAX_DEPTH = 150
"""The embedded server's tokenizer has a looser nesting limit than its worker, so that a
schema between the two passes the tokenizer's checks and fails in the worker, after the SSE
headers went out (as a compile timeout would)."""


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory: pytest.TempPathFactory, wire_keys: Path) -> Iterator[str]:
    """The three processes on the embedded SmolLM2-135M-Instruct, with jump-forward and the
    nesting limits above, shared by the client-library and grammar tests (it loads in about
    30 s on two cores). Yields the base URL."""
    launcher = ServiceLauncher(
        tmp_path_factory.mktemp("embedded-server-logs"), 1.0, env=keys_env(wire_keys)
    )
    role_flags = {
        "worker": ["--grammar-max-nesting-depth", str(EMBEDDED_WORKER_MAX_DEPTH)],
        "tokenizer": ["--grammar-max-nesting-depth", str(EMBEDDED_TOKENIZER_MAX_DEPTH)],
    }
    flags = [*cpu_flags(16384), "--enable-jump-forward"]
    with launcher.serve(flags, timeout=180, role_flags=role_flags) as url:
        yield url


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


def strict_json(text: str) -> Any:
    """`text` parsed as JSON proper: NaN, Infinity and -Infinity (which Python's parser
    takes) are not JSON, and no answer of the server may hold them."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON: {text[:300]}")

    return json.loads(text, parse_constant=refuse)
