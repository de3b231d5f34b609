"""What Kubernetes does to a pod, done to the three real processes (tokenizer, worker,
detokenizer): one container killed and restarted while the other two keep running, a
stalled worker, garbage on every ZMQ port, more load than the server takes, and requests
that run too long.

One cluster (tiny random-weight model) serves the module; a test that restarts a process
starts it again on the same ports, as a container restart does. The worker runs at most
`MAX_RUNNING` requests, so that of 16 requests most wait in its queue: both kinds must fail
cleanly when a peer goes.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
import zmq

from engine.sampling.sampling_params import SamplingParams
from services.io_struct import (
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    FinishReason,
    Heartbeat,
    TokenizedGenerateReqInput,
    WorkerReady,
    encode,
)
from services.ipc import WireKeys, connect_push
from services.process import WATCHDOG_EXIT_CODE
from services.tokenizer.server import MAX_REQUEST_BODY_BYTES
from testing.launcher import (
    REPO_ROOT,
    ROLES,
    ServiceLauncher,
    cpu_flags,
    port_flags,
    server_ports,
)
from testing.net import all_kv_free, free_ports, http_status, server_info, wait_until
from tests.services.conftest import keys_env

HEARTBEAT_INTERVAL = 0.5
"""Slower than the other service tests' 0.2 s, so a loaded machine never fakes a death."""
PEER_TIMEOUT = 4.0
"""--peer-timeout: a peer silent this long is dead though its connections stay up."""
DEATH_NOTICED_S = 10.0
"""In-flight requests must fail within this long of a kill (its connections drop, then 3
missed beats: 1.5 s) or of a freeze (`PEER_TIMEOUT`), plus slack."""
MAX_TOTAL_TOKENS = 32768
MAX_RUNNING = 4
STREAMS = 16
CONTEXT_LENGTH = 65536
LONG = {"max_tokens": 60000, "ignore_eos": True}
"""Far longer than any test waits, on any machine (the cluster's context and max_tokens cap
admit it): a stream that ends did not end by finishing."""
REQUEST_TIMEOUT = 15
SHEDDING = ["--max-queued-requests", "2", "--request-timeout", str(REQUEST_TIMEOUT)]
"""The tokenizer's flags for the load-shedding tests (the last ones of the module)."""


class Cluster:
    """The three services on fixed ports; any one can be killed and started again."""

    def __init__(self, launcher: ServiceLauncher, model_dir: Path, keys_dir: Path):
        self.launcher = launcher
        self.keys_dir = keys_dir
        self.ports = server_ports()
        self.flags = [
            *cpu_flags(MAX_TOTAL_TOKENS, model_dir),
            "--context-length",
            str(CONTEXT_LENGTH),
            "--max-tokens-cap",
            str(LONG["max_tokens"]),
            "--host",
            "127.0.0.1",
            "--max-running-requests",
            str(MAX_RUNNING),
            "--peer-timeout",
            str(PEER_TIMEOUT),
            *port_flags(self.ports),
        ]
        self.extra: dict[str, list[str]] = {}
        self.lives: dict[str, int] = {}
        self.url = f"http://127.0.0.1:{self.ports['port']}"

    def start(self, role: str, extra: list[str] | None = None) -> None:
        """Start `role` (again), keeping the logs of its previous lives as `<role>.<n>.log`."""
        log = self.launcher.log_dir / f"{role}.log"
        if role in self.lives:
            log.rename(log.with_suffix(f".{self.lives[role]}.log"))
        self.lives[role] = self.lives.get(role, 0) + 1
        self.extra[role] = list(extra or [])
        self.launcher.start(role, [*self.flags, *self.extra[role]])

    def proc(self, role: str) -> subprocess.Popen:
        return self.launcher.procs[role]

    def pids(self) -> dict[str, int]:
        return {role: self.proc(role).pid for role in ROLES}

    def signal(self, role: str, sig: signal.Signals) -> None:
        self.proc(role).send_signal(sig)

    def kill(self, role: str) -> None:
        self.signal(role, signal.SIGKILL)
        self.proc(role).wait(10)

    def all_running(self) -> bool:
        return all(self.proc(role).poll() is None for role in ROLES)

    def log(self, role: str) -> str:
        return self.launcher.log(role)

    def wait_ready(self, timeout: float = 120) -> None:
        wait_until(lambda: http_status(self.url + "/health") == 200, timeout, "/health 200")


@pytest.fixture(scope="module")
def cluster(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, wire_keys: Path
) -> Iterator[Cluster]:
    launcher = ServiceLauncher(
        tmp_path_factory.mktemp("resilience-logs"), HEARTBEAT_INTERVAL, env=keys_env(wire_keys)
    )
    cluster = Cluster(launcher, tiny_llama_dir, wire_keys)
    for role in ROLES:
        cluster.start(role)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        launcher.stop_all()


@pytest.fixture
def http(cluster: Cluster) -> Iterator[httpx2.Client]:
    """A client of a ready server; at the end the server must still be whole: every process
    running, and every KV slot back (no request left holding one)."""
    cluster.wait_ready()
    with httpx2.Client(base_url=cluster.url, timeout=60) as client:
        yield client
        assert cluster.all_running()
        wait_until(lambda: all_kv_free(client), 60, "every KV slot to be free again")


def completion_works(client: httpx2.Client) -> dict[str, Any]:
    """A native generation and a completion succeed. Called right after a restart, the first
    one also proves that no output batch was lost while the processes reconnected: every
    token the worker counted reached the client."""
    params = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}
    native = client.post("/generate", json={"text": "Once upon a time", "sampling_params": params})
    assert native.status_code == 200, native.text
    meta = native.json()["meta_info"]
    assert len(native.json()["output_ids"]) == meta["completion_tokens"] == 8, native.json()
    response = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    return response.json()


def assert_error_body(response: httpx2.Response, status_code: int, code: str) -> dict[str, Any]:
    assert response.status_code == status_code, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    assert "Traceback" not in response.text
    return error


# ----- streams in flight ----------------------------------------------------------------------


StreamResult = tuple[int, list[str], float]
"""HTTP status (-1: the connection broke), SSE data lines, when it ended (time.monotonic())."""


async def _stream(client: httpx2.AsyncClient, body: dict[str, Any]) -> StreamResult:
    events: list[str] = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
            return response.status_code, events, time.monotonic()
    except httpx2.TransportError as e:  # the tokenizer itself was killed
        return -1, [*events, repr(e)], time.monotonic()


def run_streams(url: str, count: int, during: Callable[[], None]) -> list[StreamResult]:
    """Open `count` long streaming completions from another thread, call `during()` once the
    tokenizer holds all of them and the worker runs as many as it may, then wait for each
    to end."""
    results: list[StreamResult] = []

    async def run() -> None:
        async with httpx2.AsyncClient(base_url=url, timeout=120) as client:
            bodies = [
                {"prompt": f"Stream number {i} tells a story:", "stream": True, **LONG}
                for i in range(count)
            ]
            results.extend(await asyncio.gather(*(_stream(client, body) for body in bodies)))

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    with httpx2.Client(base_url=url, timeout=30) as client:
        wait_until(
            lambda: server_info(client)["num_in_flight_requests"] == count,
            60,
            f"{count} requests in flight",
        )
        wait_until(
            lambda: server_info(client)["num_running_reqs"] == min(count, MAX_RUNNING),
            60,
            "running requests",
        )
    during()
    thread.join(120)
    assert not thread.is_alive(), "streams still open two minutes after the fault"
    return results


def assert_each_ended_with_an_error_event(
    results: list[StreamResult], since: float, code: str, words: str
) -> None:
    for status_code, events, ended in results:
        assert status_code == 200 and events[-1] == "[DONE]", (status_code, events[-3:])
        *chunks, error = [json.loads(e) for e in events[:-1]]
        assert error["error"]["code"] == code and words in error["error"]["message"], error
        assert all(
            choice["finish_reason"] is None for chunk in chunks for choice in chunk["choices"]
        )
        assert ended - since < DEATH_NOTICED_S, (
            f"a stream ended {ended - since:.1f} s after the fault"
        )


# ----- restarts -------------------------------------------------------------------------------


def test_worker_killed_mid_stream_fails_every_request_then_a_new_worker_resumes_service(
    cluster: Cluster, http: httpx2.Client
):
    before = cluster.pids()
    killed_at: list[float] = []

    def kill_worker() -> None:
        killed_at.append(time.monotonic())
        cluster.kill("worker")

    results = run_streams(cluster.url, STREAMS, kill_worker)
    assert_each_ended_with_an_error_event(
        results, killed_at[0], "service_unavailable", "worker process"
    )
    # Meanwhile the tokenizer says so, and answers at once instead of hanging.
    wait_until(lambda: http_status(cluster.url + "/health") == 503, DEATH_NOTICED_S, "/health 503")
    assert_error_body(http.get("/health"), 503, "service_unavailable")
    started = time.monotonic()
    assert_error_body(
        http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
        503,
        "service_unavailable",
    )
    refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert_error_body(refused, 503, "service_unavailable")
    assert time.monotonic() - started < 5

    cluster.start("worker")
    cluster.wait_ready()
    new_id = completion_works(http)["id"]
    after = cluster.pids()
    assert after["worker"] != before["worker"]
    assert {r: after[r] for r in ("tokenizer", "detokenizer")} == {
        r: before[r] for r in ("tokenizer", "detokenizer")
    }
    # Request ids are the tokenizer's uuid4s, never reused: no output of the lost requests
    # can be taken for a new one's, whichever worker life produced it.
    ids = {json.loads(events[0]).get("id") for _, events, _ in results} - {None}
    assert ids and new_id not in ids


def test_detokenizer_killed_mid_stream_fails_every_request_then_a_new_one_resumes_service(
    cluster: Cluster, http: httpx2.Client
):
    before = cluster.pids()
    killed_at: list[float] = []

    def kill_detokenizer() -> None:
        killed_at.append(time.monotonic())
        cluster.kill("detokenizer")

    results = run_streams(cluster.url, STREAMS, kill_detokenizer)
    assert_each_ended_with_an_error_event(
        results, killed_at[0], "service_unavailable", "detokenizer process"
    )
    wait_until(lambda: http_status(cluster.url + "/health") == 503, DEATH_NOTICED_S, "/health 503")
    assert_error_body(
        http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
        503,
        "service_unavailable",
    )
    # The tokenizer aborted the failed requests, so the worker gave back their KV.
    wait_until(lambda: all_kv_free(http), 30, "the worker to free the failed requests' KV")

    cluster.start("detokenizer")
    cluster.wait_ready()
    completion_works(http)
    after = cluster.pids()
    assert after["detokenizer"] != before["detokenizer"]
    assert {r: after[r] for r in ("tokenizer", "worker")} == {
        r: before[r] for r in ("tokenizer", "worker")
    }


def test_tokenizer_killed_mid_stream_its_requests_are_aborted_and_their_kv_freed(
    cluster: Cluster, http: httpx2.Client
):
    before = cluster.pids()
    results = run_streams(cluster.url, STREAMS, lambda: cluster.kill("tokenizer"))
    assert all(status_code == -1 for status_code, _, _ in results)  # their connections went with it
    # The worker still holds the 16 requests (nobody told it otherwise) until the new
    # tokenizer announces itself; then it aborts those of the tokenizer's previous life.
    cluster.start("tokenizer", cluster.extra["tokenizer"])
    cluster.wait_ready()
    wait_until(lambda: all_kv_free(http), 30, "the orphaned requests' KV to be freed")
    assert f"aborting {STREAMS} request(s) of its previous life" in cluster.log("worker")
    completion_works(http)
    after = cluster.pids()
    assert after["tokenizer"] != before["tokenizer"]
    assert {r: after[r] for r in ("worker", "detokenizer")} == {
        r: before[r] for r in ("worker", "detokenizer")
    }


def test_worker_starved_in_bursts_longer_than_three_heartbeats_is_not_declared_dead(
    cluster: Cluster, http: httpx2.Client
):
    """A busy host takes the CPU from the worker for seconds at a time: here a competing
    process stops it for 2 s (four heartbeat intervals, past the three that once meant
    death) in every 2.5 s. Its connections stay up, so only `PEER_TIMEOUT` of silence
    would be a death: every request is served, and no peer is declared dead."""
    starving = threading.Event()

    def starve() -> None:
        while not starving.is_set():
            cluster.signal("worker", signal.SIGSTOP)
            time.sleep(4 * HEARTBEAT_INTERVAL)
            cluster.signal("worker", signal.SIGCONT)
            time.sleep(HEARTBEAT_INTERVAL)

    peers = ("tokenizer", "detokenizer")
    logged = {role: len(cluster.log(role)) for role in peers}
    competitor = threading.Thread(target=starve, daemon=True)
    competitor.start()
    try:
        started = time.monotonic()
        statuses = []
        while time.monotonic() - started < 4 * (4 + 1) * HEARTBEAT_INTERVAL:  # four bursts
            body = {"prompt": "Count:", "max_tokens": 8, "temperature": 0}
            statuses.append(http.post("/v1/completions", json=body, timeout=60).status_code)
    finally:
        starving.set()
        competitor.join()
        cluster.signal("worker", signal.SIGCONT)
    assert statuses and set(statuses) == {200}, statuses
    for role in peers:
        assert " dead " not in cluster.log(role)[logged[role] :], role
    assert http_status(cluster.url + "/health") == 200


def test_worker_frozen_past_the_peer_timeout_is_failed_and_rejoins_when_it_resumes(
    cluster: Cluster, http: httpx2.Client
):
    """SIGSTOP freezes the whole process, heartbeat thread included, with its connections
    up: once silent for `PEER_TIMEOUT` it is dead to its peers. (Its own watchdog, which
    needs that thread, is tested below on its own.)"""
    before = cluster.pids()
    stopped_at: list[float] = []

    def stop_worker() -> None:
        stopped_at.append(time.monotonic())
        cluster.signal("worker", signal.SIGSTOP)

    try:
        results = run_streams(cluster.url, 6, stop_worker)
        assert_each_ended_with_an_error_event(
            results, stopped_at[0], "service_unavailable", "worker process"
        )
        assert http_status(cluster.url + "/health") == 503
    finally:
        cluster.signal("worker", signal.SIGCONT)
    # Same life (same epoch), so no restart: it is heard again, and the aborts the tokenizer
    # sent while it was frozen free the failed requests' KV.
    cluster.wait_ready(30)
    completion_works(http)
    assert cluster.pids() == before


# ----- the watchdog ---------------------------------------------------------------------------

STUCK_SERVICE = """
import sys, time
from services.process import Service, configure_logging
from services.settings import Settings

class Stuck(Service):
    role = "stuck"
    steps = 0

    def __init__(self, settings):
        super().__init__(settings, settings.worker_port)
        self.connect(settings.tokenizer_control_port)

    def handle(self, msg):
        pass

    def has_work(self):
        return True

    def step(self):
        # Slow turns first (each well under the timeout), then two turns twice as long as
        # the timeout that show progress as they compute (as a prefill's layers do), then
        # one that never ends.
        self.steps += 1
        print("step", self.steps, flush=True)
        if self.steps <= 8:
            time.sleep(0.4)
        elif self.steps <= 10:
            for _ in range(15):
                time.sleep(0.2)
                self.mark_progress()
        else:
            time.sleep(3600)

ports = [int(p) for p in sys.argv[1:]]
settings = Settings(worker_port=ports[0], tokenizer_control_port=ports[1], heartbeat_interval=0.2,
                    watchdog_timeout=1.5)
configure_logging("info", "stuck")
Stuck(settings).serve_forever()
"""


def test_watchdog_spares_a_long_turn_that_progresses_and_ends_a_stuck_one_with_status_3(
    tmp_path: Path,
):
    ports = [str(port) for port in free_ports(2)]
    proc = subprocess.run(
        [sys.executable, "-c", STUCK_SERVICE, *ports],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == WATCHDOG_EXIT_CODE, proc.stderr
    # 8 slow turns of 0.4 s and 2 of 3 s that progressed did not trip a 1.5 s watchdog
    assert "step 11" in proc.stdout
    assert "step 12" not in proc.stdout
    assert "watchdog: the stuck loop has made no progress for" in proc.stderr
    assert "(--watchdog-timeout 1.5); exiting" in proc.stderr


# ----- garbage on the wire ----------------------------------------------------------------------


def garbage(rng: random.Random) -> list[list[bytes]]:
    """Frames a buggy or hostile local process might send: random bytes, every valid
    message cut short, msgpack of unknown or ill-typed messages, several frames at once."""
    params = SamplingParams(max_new_tokens=4)
    valid = [
        TokenizedGenerateReqInput(rid="x", input_ids=[1, 2, 3], sampling_params=params),
        AbortReq(rid="x"),
        Heartbeat(sender="worker", epoch="e"),
        WorkerReady(
            model_path="m",
            served_model_name="m",
            max_total_tokens=1,
            context_length=1,
            vocab_size=1,
            eos_token_ids=[0],
            max_running_requests=1,
        ),
        BatchTokenIDOutput(
            rids=["x"],
            output_ids=[[1]],
            finished_reasons=[FinishReason("stop")],
            prompt_tokens=[1],
            completion_tokens=[1],
            cached_tokens=[0],
        ),
        BatchStrOutput(
            rids=["x"],
            output_ids=[[1]],
            finished_reasons=[None],
            prompt_tokens=[1],
            completion_tokens=[1],
            cached_tokens=[0],
            output_strs=["a"],
        ),
    ]
    frames: list[list[bytes]] = [
        [rng.randbytes(rng.choice((0, 1, 7, 64, 4096)))] for _ in range(60)
    ]
    for msg in valid:
        data = encode(msg)
        frames += [[data[:cut]] for cut in sorted(rng.sample(range(len(data)), min(len(data), 8)))]
    pack = msgspec.msgpack.encode
    frames += [
        [pack(x)]
        for x in (
            {"type": "Bogus"},
            {"type": "AbortReq"},
            {"type": "AbortReq", "rid": 7},
            {"rid": "x"},
            [1, 2, 3],
            "str",
            None,
            {
                "type": "BatchStrOutput",
                "rids": ["a", "b"],
                "output_ids": [[1]],
                "finished_reasons": [None],
                "prompt_tokens": [1],
                "completion_tokens": [1],
                "cached_tokens": [0],
                "output_strs": ["a"],
            },
            {
                "type": "TokenizedGenerateReqInput",
                "rid": "x",
                "input_ids": [1],
                "sampling_params": {"n": "many"},
            },
            {"type": "AbortReq", "rid": "x", "sender": ["not", "a", "str"]},
            [[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]],
        )
    ]
    frames.append([b"\x91" * 100_000])  # an array nested 100,000 deep
    frames.append([encode(AbortReq(rid="x")), b"second frame"])
    return frames


def test_garbage_on_every_zmq_port_is_dropped_and_every_process_keeps_serving(
    cluster: Cluster, http: httpx2.Client
):
    """From a buggy process that holds the pod's wire keys (one without them cannot connect:
    test_wire_auth.py)."""
    rng = random.Random(6)
    keys = WireKeys.load(cluster.keys_dir, "worker")
    ctx = zmq.Context()
    try:
        for name, server in (
            ("worker-port", "worker"),
            ("detokenizer-port", "detokenizer"),
            ("tokenizer-port", "tokenizer"),
            ("tokenizer-control-port", "tokenizer"),
        ):
            port = cluster.ports[name]
            sock = connect_push(ctx, port, keys=keys, server=server)
            for frames in garbage(rng):
                deadline = time.monotonic() + 10
                while True:
                    try:
                        sock.send_multipart(frames, zmq.NOBLOCK)
                        break
                    except zmq.Again:  # IMMEDIATE: not connected yet
                        assert time.monotonic() < deadline, f"cannot connect to {name}"
                        time.sleep(0.01)
            sock.close(linger=5000)
            # Not even ZMQ: raw bytes at the TCP port end that connection, nothing else.
            for _ in range(5):
                with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                    raw.sendall(rng.randbytes(rng.choice((1, 10, 1000, 100_000))))
    finally:
        ctx.destroy(linger=0)
    time.sleep(3 * HEARTBEAT_INTERVAL)  # long enough for a fault to show as a death
    assert cluster.all_running()
    assert http_status(cluster.url + "/health") == 200
    completion_works(http)
    for role in ("worker", "detokenizer", "tokenizer"):
        assert "dropped" in cluster.log(role), f"the {role} logged no dropped message"
    assert "Traceback" not in cluster.log("worker") + cluster.log("detokenizer")


# ----- limits ----------------------------------------------------------------------------------


def test_body_over_the_limit_gets_413_whether_its_length_is_declared_or_not(http: httpx2.Client):
    body = json.dumps({"prompt": "x" * MAX_REQUEST_BODY_BYTES}).encode()
    assert_error_body(
        http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}),
        413,
        "request_too_large",
    )

    def chunks() -> Iterator[bytes]:  # chunked transfer: no Content-Length to go by
        for start in range(0, len(body), 2**20):
            yield body[start : start + 2**20]

    response = http.post(
        "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert_error_body(response, 413, "request_too_large")
    completion_works(http)


def test_abort_by_response_id_stops_its_choices_and_a_bare_prefix_stops_nothing(
    http: httpx2.Client,
):
    body = {"prompt": "abort me", "stream": True, "n": 2, **LONG}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = (
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
        )
        rid = json.loads(next(events))["id"]
        for prefix in ("cmpl", rid[:-1], rid + "-"):
            assert http.post("/abort_request", json={"rid": prefix}).json() == {"aborted": 0}, (
                prefix
            )
        assert http.post("/abort_request", json={"rid": rid}).json() == {"aborted": 2}
        rest = list(events)
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(event) for event in rest[:-1]]
    assert not any("error" in chunk for chunk in chunks)
    finished = {
        choice["index"]: choice["finish_reason"]
        for chunk in chunks
        for choice in chunk["choices"]
        if choice["finish_reason"] is not None
    }
    assert finished == {0: "abort", 1: "abort"}


@pytest.fixture
def shedding(cluster: Cluster) -> Cluster:
    """The tokenizer restarted with SHEDDING's limits (left so for the tests after it)."""
    if cluster.extra.get("tokenizer") != SHEDDING:
        cluster.proc("tokenizer").terminate()
        cluster.proc("tokenizer").wait(30)
        cluster.start("tokenizer", SHEDDING)
    cluster.wait_ready()
    return cluster


def test_requests_past_max_queued_requests_get_429(shedding: Cluster, http: httpx2.Client):
    """Limit 2: with the worker's MAX_RUNNING slots busy, two requests may wait for a first
    token; a third, streamed or not, is refused with a 429 before any response starts."""
    stop = threading.Event()
    opened: list[int] = []

    async def hold(i: int, client: httpx2.AsyncClient, first: asyncio.Event) -> None:
        async with client.stream(
            "POST", "/v1/completions", json={"prompt": f"hold {i}", "stream": True, **LONG}
        ) as r:
            opened.append(r.status_code)
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    first.set()
                if stop.is_set():
                    return

    async def run() -> None:
        async with httpx2.AsyncClient(base_url=shedding.url, timeout=60) as client:
            tasks = []
            for i in range(MAX_RUNNING):  # one at a time: each is running before the next comes
                first = asyncio.Event()
                tasks.append(asyncio.create_task(hold(i, client, first)))
                await asyncio.wait_for(first.wait(), 30)
            for i in range(2):  # these wait: no free running slot
                tasks.append(asyncio.create_task(hold(MAX_RUNNING + i, client, asyncio.Event())))
            while not stop.is_set():
                await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    try:
        wait_until(lambda: server_info(http)["num_queued_requests"] == 2, 30, "two queued requests")
        assert server_info(http)["num_waiting_reqs"] == 2
        for path, body in (
            ("/v1/completions", {"prompt": "one too many", "max_tokens": 2}),
            ("/v1/completions", {"prompt": "one too many", "max_tokens": 2, "stream": True}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "stream": True},
            ),
            ("/generate", {"text": "one too many", "sampling_params": {"max_new_tokens": 2}}),
        ):
            error = assert_error_body(http.post(path, json=body), 429, "too_many_requests")
            assert (
                "--max-queued-requests 2" in error["message"]
                and error["type"] == "invalid_request_error"
            )
        # More sequences in one request than may ever wait is the client's mistake, not load.
        error = assert_error_body(
            http.post("/v1/completions", json={"prompt": "hi", "n": 3}), 400, "invalid_value"
        )
        assert error["param"] == "n"
        assert opened == [200] * (MAX_RUNNING + 2)
    finally:
        stop.set()
        thread.join(30)
    http.post("/abort_request", json={"abort_all": True})
    wait_until(lambda: server_info(http)["num_queued_requests"] == 0, 30, "the queue to drain")
    completion_works(http)


def test_request_past_request_timeout_is_aborted_with_504_and_its_kv_freed(
    shedding: Cluster, http: httpx2.Client
):
    async def run() -> tuple[httpx2.Response, StreamResult]:
        async with httpx2.AsyncClient(base_url=shedding.url, timeout=120) as client:
            whole = client.post("/v1/completions", json={"prompt": "forever", **LONG})
            streamed = _stream(client, {"prompt": "forever", "stream": True, **LONG})
            return await asyncio.gather(whole, streamed)

    started = time.monotonic()
    response, (status_code, events, ended) = asyncio.run(run())
    error = assert_error_body(response, 504, "request_timeout")
    assert "--request-timeout" in error["message"] and error["type"] == "server_error"
    assert REQUEST_TIMEOUT - 0.5 < ended - started < 3 * REQUEST_TIMEOUT
    assert status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert len(events) > 3  # it streamed tokens until the timeout
    # The http fixture then checks that both requests' KV came back.
