"""`/metrics` and `/healthz` for the processes that speak no HTTP (worker, detokenizer).

A small threaded HTTP server beside the ZMQ loop: a scrape or a probe never waits for
the loop, and a stuck loop is exactly what `/healthz` must be able to report.

It binds `--host`, as the API does: the kubelet's probes and Prometheus reach these ports
on the pod's IP (in a pod, 0.0.0.0 is that IP and loopback, nothing wider), and the
tokenizer reads the worker's `/metrics` on loopback. A client gets `READ_TIMEOUT_S` to send
its request, and every answer closes the connection (HTTP/1.0), so a stalled client holds
one thread for seconds at most.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0
"""Seconds a client has for each read of its request (the probes' own timeout is 5 s)."""

HealthCheck = Callable[[], str | None]
"""Returns None when healthy, else why not (sent with the 503)."""


class MetricsServer:
    """Serves `registry` on GET /metrics and `health()` on GET /healthz, from a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: HealthCheck,
        read_timeout: float = READ_TIMEOUT_S,
    ):
        handler = _handler(registry, health, read_timeout)
        server_cls = _IPv6Server if ":" in host else ThreadingHTTPServer
        self.server = server_cls((host, port), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="metrics-http", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_metrics_server(
    host: str, port: int, registry: CollectorRegistry, health: HealthCheck
) -> MetricsServer | None:
    """A running MetricsServer, or None (logged) when the port cannot be bound: losing
    metrics must not take the serving process down with it."""
    try:
        server = MetricsServer(host, port, registry, health)
    except OSError as e:
        logger.error("cannot serve /metrics and /healthz on %s:%d: %s", host, port, e)
        return None
    logger.info("serving /metrics and /healthz on %s:%d", host, server.port)
    return server


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _handler(
    registry: CollectorRegistry, health: HealthCheck, read_timeout: float
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = read_timeout

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                problem = health()
                self._reply(200 if problem is None else 503, (problem or "ok").encode() + b"\n")
            else:
                self._reply(404, b"not found: try /metrics or /healthz\n")

        def _reply(
            self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8"
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a scrape every few seconds is not news

    return Handler
