"""The worker's series on the API port, in process: a real `metrics_server` plays the
worker, and a closed port and a silent one play a worker that is down or stuck."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from observability.metrics import TokenizerMetrics
from observability.metrics_server import MetricsServer
from services.tokenizer.worker_metrics_proxy import WorkerMetricsProxy, loopback_host


def type_names(exposition: bytes) -> list[str]:
    return [
        line.split()[2].decode() for line in exposition.splitlines() if line.startswith(b"# TYPE")
    ]


@pytest.fixture
def metrics() -> TokenizerMetrics:
    return TokenizerMetrics(CollectorRegistry(), "m")


@pytest.fixture
def worker() -> Iterator[MetricsServer]:
    registry = CollectorRegistry()
    Gauge("radixserve_num_requests_waiting", "waiting", registry=registry).set(3)
    server = MetricsServer("127.0.0.1", 0, registry, lambda: None)
    yield server
    server.close()


def failures(metrics: TokenizerMetrics) -> float:
    value = metrics.registry.get_sample_value(
        "radixserve_worker_metrics_scrape_failures_total", {"model_name": "m"}
    )
    assert value is not None
    return value


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("0.0.0.0", "127.0.0.1"), ("", "127.0.0.1"), ("::", "::1"), ("10.1.2.3", "10.1.2.3")],
)
def test_the_worker_is_reached_on_the_loopback_of_a_wildcard_host(host: str, loopback: str):
    assert loopback_host(host) == loopback


def test_the_merged_exposition_appends_the_workers_families(
    worker: MetricsServer, metrics: TokenizerMetrics
):
    proxy = WorkerMetricsProxy("0.0.0.0", worker.port, metrics)
    scraped = asyncio.run(proxy.scrape())
    assert b"radixserve_num_requests_waiting 3.0" in scraped
    merged = proxy.merged(generate_latest(metrics.registry), scraped)
    names = type_names(merged)
    assert "radixserve_num_requests_waiting" in names and "radixserve_requests_total" in names
    assert len(names) == len(set(names))
    assert failures(metrics) == 0


def test_a_family_the_tokenizer_has_is_left_out_of_the_workers(metrics: TokenizerMetrics):
    proxy = WorkerMetricsProxy("127.0.0.1", 1, metrics)
    own = generate_latest(metrics.registry)
    clash = CollectorRegistry()
    Gauge("radixserve_aborted_requests_total", "clash", registry=clash).set(7)
    Gauge("radixserve_kv_usage_ratio", "kv", registry=clash).set(0.5)
    merged = proxy.merged(own, generate_latest(clash))
    names = type_names(merged)
    assert len(names) == len(set(names)) and "radixserve_kv_usage_ratio" in names
    assert b"radixserve_aborted_requests_total 7.0" not in merged


def test_a_worker_that_is_down_leaves_the_tokenizers_series_and_counts_a_failure(
    metrics: TokenizerMetrics,
):
    with socket.socket() as s:  # a port just freed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = WorkerMetricsProxy("127.0.0.1", port, metrics)
    assert asyncio.run(proxy.scrape()) == b""
    assert failures(metrics) == 1


def test_a_worker_that_never_answers_costs_one_timeout(metrics: TokenizerMetrics):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts connections, never answers
        proxy = WorkerMetricsProxy("127.0.0.1", silent.getsockname()[1], metrics, timeout=0.3)
        started = time.monotonic()
        assert asyncio.run(proxy.scrape()) == b""
        assert time.monotonic() - started < 2
    assert failures(metrics) == 1
