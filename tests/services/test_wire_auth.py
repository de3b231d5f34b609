"""The authenticated wire: with `--ipc-keys-dir`, a local process without the pod's keys
cannot join any ZMQ port, whether it speaks plain ZMQ or CURVE with a key of its own. Its
spoofed `Hello` (which would retire the real peer's epoch), aborts, requests and outputs
never reach a process, while 8 streams in flight finish with the output they have without
the attack."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.sampling.sampling_params import SamplingParams
from services.io_struct import (
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    Hello,
    Message,
    TokenizedGenerateReqInput,
    encode,
    new_epoch,
)
from services.ipc import WireKeys, WireKeysError, create_wire_keys
from testing.launcher import ServiceLauncher, cpu_flags, server_ports
from testing.net import all_kv_free, server_info, wait_until
from tests.services.conftest import keys_env

STREAMS = 8
MAX_TOKENS = 4096
"""Long enough that the streams still flow once every attack was refused (256 let them finish
first on an AMX Xeon about one run in three, 1,024 once in a whole suite there, about 4.5 s
of streams against the attacks' handshakes; 3,072 once in a suite whose servers also start
xgrammar's compile processes)."""
POOL_TOKENS = 40960
"""The KV pool: every stream's prompt and tokens at once, so none is retracted."""
PORTS = {  # ZMQ port flag → the role that legitimately connects to it
    "worker-port": "tokenizer",
    "detokenizer-port": "worker",
    "tokenizer-port": "detokenizer",
    "tokenizer-control-port": "worker",
}
SERVERS = {"worker-port": "worker", "detokenizer-port": "detokenizer"}
"""The role that binds each port (the tokenizer binds the other two)."""
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class Server:
    def __init__(self, url: str, ports: dict[str, int], keys_dir: Path, launcher: ServiceLauncher):
        self.url = url
        self.ports = ports
        self.keys_dir = keys_dir
        self.launcher = launcher


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys_dir = create_wire_keys(tmp_path_factory.mktemp("wire-auth") / "keys")
    launcher = ServiceLauncher(tmp_path_factory.mktemp("wire-auth-logs"), env=keys_env(keys_dir))
    ports = server_ports()
    with launcher.serve(cpu_flags(POOL_TOKENS, tiny_llama_dir), ports=ports) as url:
        yield Server(url, ports, keys_dir, launcher)


def prompts() -> list[str]:
    return [f"Stream number {i} tells the story of" for i in range(STREAMS)]


def stream(url: str, prompt: str, first: threading.Barrier, results: dict[str, object]) -> None:
    """One greedy completion stream; waits at `first` once its first event is in."""
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, rid = [], None
    try:
        with httpx2.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                assert "error" not in event, event
                if rid is None:
                    rid = event["id"]
                    results[f"id:{prompt}"] = rid
                    first.wait(60)
                text.append(event["choices"][0]["text"])
                finish = event["choices"][0]["finish_reason"]
        results[prompt] = ("".join(text), finish)
    except BaseException as e:  # reported by the test, not lost in the thread
        results[prompt] = e
        first.abort()


def run_streams(url: str, during: object = None) -> dict[str, object]:
    """The 8 streams; `during(ids)` runs once all have their first event, while they flow."""
    results: dict[str, object] = {}
    first = threading.Barrier(STREAMS + 1)
    threads = [threading.Thread(target=stream, args=(url, p, first, results)) for p in prompts()]
    for thread in threads:
        thread.start()
    try:
        first.wait(120)
        if callable(during):
            during([results[f"id:{p}"] for p in prompts()])
    finally:
        for thread in threads:
            thread.join(120)
    return {p: results[p] for p in prompts()}


def spoofed(port_name: str, ids: list[str]) -> list[Message]:
    """What an attacker would send on `port_name`: a Hello claiming to be its legitimate
    client (a new epoch retires the real one's), aborts of the live requests, a request,
    and outputs that would end or extend the streams."""
    rids = [f"{i}-0" for i in ids]
    role, n = PORTS[port_name], len(rids)
    zeros = [0] * n
    return [
        Hello(sender=role, epoch=new_epoch()),
        *(AbortReq(rid=rid, sender=role) for rid in rids),
        TokenizedGenerateReqInput(
            rid="spoofed-0",
            input_ids=[1, 2, 3],
            sampling_params=SamplingParams(max_new_tokens=4),
            sender=role,
        ),
        BatchTokenIDOutput(
            rids=rids,
            output_ids=[[1]] * n,
            finished_reasons=[None] * n,
            prompt_tokens=zeros,
            completion_tokens=zeros,
            cached_tokens=zeros,
            sender=role,
        ),
        BatchStrOutput(
            rids=rids,
            output_ids=[[1]] * n,
            finished_reasons=[None] * n,
            prompt_tokens=zeros,
            completion_tokens=zeros,
            cached_tokens=zeros,
            output_strs=["INJECTED"] * n,
            sender=role,
        ),
    ]


def attacker(
    ctx: zmq.Context,
    port: int,
    server_key: bytes | None,
    client_keys: tuple[bytes, bytes] | None = None,
) -> tuple[zmq.Socket, zmq.Socket]:
    """A PUSH socket that queues what it is given until connected (no IMMEDIATE), so that
    its messages go out the moment a handshake would succeed: plain ZMQ when `server_key`
    is None, else CURVE with the server's real public key and `client_keys` (public, secret;
    default: a key pair of its own). With it, the monitor of its handshakes, attached before
    it connects so that the first handshake is seen."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    # connect() attaches the pipe that queues messages in libzmq's I/O thread, a moment later:
    # a send waits for it (a non-blocking one could find none yet and fail with EAGAIN).
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    if server_key is not None:
        public, secret = client_keys or zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    monitor = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock, monitor


def handshake_outcome(sock: zmq.Socket, monitor: zmq.Socket) -> int:
    """The first handshake event of `sock` (failed or succeeded), as libzmq reports it."""
    try:
        assert monitor.poll(30_000), "no handshake within 30 s"
        return int(recv_monitor_message(monitor)["event"])
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def server_key(keys_dir: Path, port_name: str) -> bytes:
    return WireKeys.load(keys_dir, "tokenizer").publics[SERVERS.get(port_name, "tokenizer")]


def test_spoofed_hello_abort_request_and_outputs_on_every_port_never_arrive_while_8_streams_flow(
    server: Server,
):
    reference = run_streams(server.url)
    assert all(isinstance(r, tuple) and r[1] == "length" for r in reference.values()), reference
    outcomes: dict[str, int] = {}

    def attack(ids: list[str]) -> None:
        ctx = zmq.Context()
        try:
            for name, port_flag in [(n, f) for n in PORTS for f in ("plain", "curve")]:
                key = None if port_flag == "plain" else server_key(server.keys_dir, name)
                sock, monitor = attacker(ctx, server.ports[name], key)
                for msg in spoofed(name, ids):
                    try:
                        sock.send(encode(msg))  # queued: no handshake has succeeded yet
                    except zmq.Again:  # a refused handshake dropped the pipe: none went out
                        break
                outcomes[f"{name} {port_flag}"] = handshake_outcome(sock, monitor)
                sock.close(linger=0)
            # The streams were still in flight once every attack had been refused.
            with httpx2.Client(base_url=server.url, timeout=30) as client:
                info = server_info(client)
            assert info["num_running_reqs"] + info["num_waiting_reqs"] == STREAMS, info
        finally:
            ctx.destroy(linger=0)

    attacked = run_streams(server.url, attack)
    assert len(outcomes) == 2 * len(PORTS)
    assert all(event & HANDSHAKE_FAILED for event in outcomes.values()), outcomes
    assert attacked == reference
    logs = {role: server.launcher.log(role) for role in ("worker", "detokenizer", "tokenizer")}
    for role, log in logs.items():
        assert "unknown CURVE key" in log, f"the {role} did not report the refused key"
        assert not re.search(r"peer \w+ (restart|dead)", log), f"the {role} saw a peer change"
        assert "Traceback" not in log
    with httpx2.Client(base_url=server.url, timeout=60) as client:
        again = client.post("/v1/completions", json={"prompt": "Still there?", "max_tokens": 4})
        assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"]
        wait_until(lambda: all_kv_free(client), 30, "an idle worker with every KV slot free")
        assert server_info(client, check_integrity="true")["radix_integrity"] == "ok"


def test_a_client_with_the_pods_keys_completes_the_handshake_on_every_port(server: Server):
    """The control for the test above: the monitor does see a handshake succeed."""
    keys = WireKeys.load(server.keys_dir, "worker")
    ctx = zmq.Context()
    try:
        for name in PORTS:
            server_public = keys.publics[SERVERS.get(name, "tokenizer")]
            sock, monitor = attacker(
                ctx, server.ports[name], server_public, (keys.public, keys.secret)
            )
            assert handshake_outcome(sock, monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED, name
            sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_keys_are_private_to_their_owner_and_a_readable_secret_is_refused(tmp_path: Path):
    keys_dir = create_wire_keys(tmp_path / "keys")
    assert keys_dir.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in keys_dir.iterdir()} == {0o600}
    assert sorted(p.name for p in keys_dir.iterdir()) == sorted(
        f"{role}.{ext}"
        for role in ("tokenizer", "worker", "detokenizer")
        for ext in ("key", "key_secret")
    )
    keys = WireKeys.load(keys_dir, "worker")
    assert keys.publics["worker"] == keys.public and len(set(keys.publics.values())) == 3
    (keys_dir / "worker.key_secret").chmod(0o644)
    with pytest.raises(WireKeysError, match="accessible to other users"):
        WireKeys.load(keys_dir, "worker")
    with pytest.raises(WireKeysError, match="radixserve keys DIR"):
        WireKeys.load(tmp_path / "nowhere", "worker")
