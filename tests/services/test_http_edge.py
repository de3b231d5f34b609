"""The HTTP edge against the three real processes: header and body read timeouts, the
connection cap, client disconnects, aborts, the admin key and tenants. One server (tiny
random-weight model, one-second timeouts) serves the whole module."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from testing.launcher import REPO_ROOT, ServiceLauncher, cpu_flags
from testing.net import all_kv_free, server_info, wait_until

MAX_TOTAL_TOKENS = 4096
MAX_CONNECTIONS = 64
ADMIN_KEY = "sk-admin-edge"
KEY_FILE = "# test tenants\nsk-acme-1 acme\nsk-acme-2 acme   # its second key\nsk-globex globex\n"
LONG = {"max_tokens": 3000, "ignore_eos": True}
"""Runs long enough to act on it mid-request."""


@pytest.fixture(scope="module")
def edge(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(base URL, launcher) of the module's server."""
    logs = tmp_path_factory.mktemp("http-edge-logs")
    key_file = logs / "keys"
    key_file.write_text(KEY_FILE)
    launcher = ServiceLauncher(logs)
    flags = [
        *cpu_flags(MAX_TOTAL_TOKENS, tiny_llama_dir),
        *("--api-key-file", str(key_file), "--admin-api-key", ADMIN_KEY),
        *("--cache-isolation", "tenant", "--max-connections", str(MAX_CONNECTIONS)),
        *("--http-header-timeout", "1", "--http-body-timeout", "1"),
    ]
    with launcher.serve(flags) as url:
        yield url, launcher


@pytest.fixture(scope="module")
def base_url(edge: Any) -> str:
    return str(edge[0])


def client(base_url: str, key: str) -> httpx2.Client:
    return httpx2.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture(scope="module")
def acme(base_url: str) -> Iterator[httpx2.Client]:
    with client(base_url, "sk-acme-1") as http:
        yield http


@pytest.fixture(scope="module")
def admin(base_url: str) -> Iterator[httpx2.Client]:
    with client(base_url, ADMIN_KEY) as http:
        yield http


def address(base_url: str) -> tuple[str, int]:
    host, port = base_url.removeprefix("http://").split(":")
    return host, int(port)


def raw(base_url: str, request: bytes) -> socket.socket:
    """A connection that has sent `request` (maybe a part of one) and nothing more."""
    sock = socket.create_connection(address(base_url), timeout=60)
    sock.sendall(request)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (our timeout is 60 s)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def error_of(response: bytes) -> tuple[int, dict[str, Any]]:
    """Status and OpenAI error object of a raw HTTP/1.1 response."""
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, json.loads(body)["error"]


def a_good_request_is_served(http: httpx2.Client) -> None:
    answer = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] in ("stop", "length")


def server_errors(http: httpx2.Client, endpoint: str) -> float:
    text = http.get("/metrics").text
    pattern = rf'radixserve_requests_total{{[^}}]*endpoint="{re.escape(endpoint)}"'
    pattern += r'[^}]*outcome="server_error"[^}]*} (\S+)'
    return sum(float(v) for v in re.findall(pattern, text))


def stalled_body(key: str = "sk-acme-1") -> bytes:
    """Headers that announce a 100-byte body, and 10 bytes of it."""
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\nContent-Length: 100\r\n\r\n".encode()
        + b'{"prompt":'
    )


# ----- connections ----------------------------------------------------------------------------


def test_50_stalled_bodies_are_all_answered_408_and_closed(base_url: str, acme: httpx2.Client):
    stalled = [raw(base_url, stalled_body()) for _ in range(50)]
    a_good_request_is_served(acme)  # while all 50 hold their connections
    for sock in stalled:
        status, error = error_of(read_until_closed(sock))
        assert status == 408 and error["code"] == "request_timeout", error
        assert error["type"] == "invalid_request_error"
    a_good_request_is_served(acme)
    wait_until(lambda: all_kv_free(acme), 10, "an idle server")


def test_headers_never_finished_are_closed(base_url: str, acme: httpx2.Client):
    silent = raw(base_url, b"")
    trickled = raw(base_url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    assert read_until_closed(trickled) == b"" and read_until_closed(silent) == b""
    a_good_request_is_served(acme)


def test_past_the_connection_cap_requests_get_503_until_connections_close(
    base_url: str, acme: httpx2.Client
):
    health = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    opened = [raw(base_url, health) for _ in range(MAX_CONNECTIONS + 1)]
    answers = [sock.recv(65536) for sock in opened]  # the 200s stay open (keep-alive)
    refused = [i for i, answer in enumerate(answers) if not answer.startswith(b"HTTP/1.1 200")]
    assert refused, "one connection more than the cap: at least one is refused"
    for i in refused:
        status, error = error_of(answers[i] + read_until_closed(opened[i]))
        assert status == 503 and "--max-connections" in error["message"]
    for sock in opened:
        sock.close()
    wait_until(lambda: acme.get("/v1/models").status_code == 200, 10, "a connection to be free")


def test_a_client_gone_mid_body_is_no_server_error(edge: Any, acme: httpx2.Client):
    base_url, launcher = edge
    before = server_errors(acme, "/v1/completions")
    sock = raw(base_url, stalled_body())
    sock.close()
    a_good_request_is_served(acme)
    wait_until(lambda: "client left" in launcher.log("tokenizer"), 10, "the disconnect logged")
    assert server_errors(acme, "/v1/completions") == before
    assert "Traceback" not in launcher.log("tokenizer")


# ----- aborts ---------------------------------------------------------------------------------


def test_an_aborted_stream_ends_with_finish_reason_abort(acme: httpx2.Client):
    with acme.stream(
        "POST", "/v1/completions", json={"prompt": "Hello", "stream": True, **LONG}
    ) as response:
        events = (
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
        )
        rid = json.loads(next(events))["id"]
        assert acme.post("/abort_request", json={"rid": rid}).json() == {"aborted": 1}
        rest = list(events)
    assert response.status_code == 200 and rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
    wait_until(lambda: all_kv_free(acme), 10, "the KV of the aborted request to be freed")


def test_an_aborted_answer_is_a_499_and_no_server_error(acme: httpx2.Client, admin: httpx2.Client):
    before = server_errors(acme, "/v1/chat/completions")
    answers: list[httpx2.Response] = []
    body = {"messages": [{"role": "user", "content": "Hi"}], **LONG}
    waiter = threading.Thread(
        target=lambda: answers.append(acme.post("/v1/chat/completions", json=body))
    )
    waiter.start()
    wait_until(lambda: server_info(acme)["num_running_reqs"] == 1, 30, "the request to run")
    assert admin.post("/abort_request", json={"abort_all": True}).json() == {"aborted": 1}
    waiter.join(60)
    (answer,) = answers
    assert answer.status_code == 499 and answer.json()["error"]["code"] == "request_aborted"
    assert server_errors(acme, "/v1/chat/completions") == before
    wait_until(lambda: all_kv_free(acme), 10, "the KV of the aborted request to be freed")
    a_good_request_is_served(acme)


# ----- the admin key --------------------------------------------------------------------------

OPERATOR_CALLS = [
    ("POST", "/flush_cache", None),
    ("POST", "/abort_request", {"abort_all": True}),
    ("GET", "/get_server_info?check_integrity=true", None),
]


@pytest.mark.parametrize(("method", "path", "body"), OPERATOR_CALLS)
def test_operator_endpoints_need_the_admin_key(
    base_url: str, acme: httpx2.Client, admin: httpx2.Client, method: str, path: str, body: Any
):
    wait_until(lambda: all_kv_free(acme), 10, "an idle server")
    with client(base_url, "sk-wrong") as wrong, httpx2.Client(base_url=base_url) as nobody:
        for http, status, code in [
            (acme, 403, "admin_key_required"),
            (wrong, 401, "invalid_api_key"),
            (nobody, 401, "invalid_api_key"),
        ]:
            refused = http.request(method, path, json=body)
            assert refused.status_code == status and refused.json()["error"]["code"] == code
    allowed = admin.request(method, path, json=body)
    assert allowed.status_code == 200, allowed.text
    a_good_request_is_served(acme)


def test_server_info_shows_no_key(acme: httpx2.Client):
    info = server_info(acme)
    assert "admin_api_key" not in info and "api_key" not in info
    assert ADMIN_KEY not in json.dumps(info)


# ----- tenants --------------------------------------------------------------------------------

PROMPT = "The tenants of this server share nothing, not even a prefix. " * 4


def cached_tokens(base_url: str, key: str) -> int:
    with client(base_url, key) as http:
        answer = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_tenants_share_no_cached_prefix_and_one_tenants_keys_do(base_url: str, acme: httpx2.Client):
    assert cached_tokens(base_url, "sk-acme-1") == 0
    assert cached_tokens(base_url, "sk-globex") == 0  # another tenant: nothing cached
    assert cached_tokens(base_url, "sk-acme-1") > 0  # the same key: its prefix
    assert cached_tokens(base_url, "sk-acme-2") > 0  # another key of the same tenant
    assert cached_tokens(base_url, ADMIN_KEY) == 0  # the admin key is no tenant's
    assert server_info(acme, check_integrity="false")["num_running_reqs"] == 0


def test_a_key_not_in_the_file_is_refused(base_url: str, acme: httpx2.Client):
    with client(base_url, "sk-acme-3") as stranger:
        refused = stranger.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    a_good_request_is_served(acme)


def test_a_malformed_key_file_stops_the_tokenizer_at_start(tiny_llama_dir: Path, tmp_path: Path):
    key_file = tmp_path / "keys"
    key_file.write_text("sk-fine acme\nsk-secret acme extra-field\n")
    started = subprocess.run(
        [sys.executable, "-m", "services.tokenizer", "--model", str(tiny_llama_dir)]
        + ["--api-key-file", str(key_file), "--port", "1", "--ipc-dir", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    assert f"{key_file}:2: expected 'key [tenant]', got 3 fields" in started.stderr
    assert "sk-secret" not in started.stderr
