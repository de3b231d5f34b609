"""Prometheus metric definitions. Every metric lives on a registry passed in, never on the
global one, so two servers or engines in one process never collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


def status_outcome(status: int) -> str:
    """A low-cardinality outcome label from an HTTP status."""
    if status < 400:
        return "success"
    return "client_error" if status < 500 else "server_error"


class TokenizerMetrics:
    """What the tokenizer process exports on its `/metrics`."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.registry = registry
        self.requests = Counter(
            "radixserve_requests",
            "HTTP requests answered, by endpoint and outcome (success, client_error, server_error)",
            ["model_name", "endpoint", "outcome"],
            registry=registry,
        )
        self.model_name = model_name

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(self.model_name, endpoint, status_outcome(status)).inc()
