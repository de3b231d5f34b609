"""The worker's and detokenizer's `/metrics` and `/healthz` server: a client that stalls is
dropped after the read timeout, and the server keeps answering probes meanwhile."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx2
import pytest
from prometheus_client import CollectorRegistry

from observability.metrics_server import MetricsServer

READ_TIMEOUT_S = 0.5


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    server = MetricsServer("127.0.0.1", 0, CollectorRegistry(), lambda: None, READ_TIMEOUT_S)
    yield server
    server.close()


def test_a_client_that_never_finishes_its_request_is_dropped(server: MetricsServer):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as stalled:
        stalled.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no blank line: never ends
        assert httpx2.get(f"http://127.0.0.1:{server.port}/healthz").status_code == 200
        assert stalled.recv(1024) == b""  # closed by the server, not by our 30 s timeout
    assert httpx2.get(f"http://127.0.0.1:{server.port}/healthz").status_code == 200
