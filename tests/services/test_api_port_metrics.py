"""The worker's series on the API port (issue 18), against the three real processes: a
scraper of the serving port alone (the inference extension's endpoint picker) sees live
queue and KV gauges, and the chart's ServiceMonitor scrapes each family from one port
only, so dashboards and alerts never count a series twice."""

from __future__ import annotations

import threading

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testing.net import all_kv_free, wait_until
from tests.deploy.conftest import helm_template
from tests.services.conftest import ROUTER_FACING_MAX_RUNNING, RouterFacingServer

MAX_RUNNING = ROUTER_FACING_MAX_RUNNING
STREAMS = 4
"""Two run, two wait."""
SCRAPED_PORT_FLAGS = {
    "http": "port",
    "worker-metrics": "worker-metrics-port",
    "detok-metrics": "detokenizer-metrics-port",
}
"""The chart's port names, as the server's port flags."""


@pytest.fixture
def server(router_facing_server: RouterFacingServer) -> RouterFacingServer:
    return router_facing_server


def family_names(exposition: str) -> list[str]:
    """Every family's name, once per time it appears (from its `# TYPE` line)."""
    return [line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE ")]


def gauge(exposition: str, name: str) -> float:
    values = [
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name
    ]
    assert len(values) == 1, f"{name}: {values}"
    return values[0]


def stream_until(url: str, stop: threading.Event) -> None:
    """One long streamed completion, read until `stop` (leaving aborts it)."""
    body = {
        "prompt": "Tell me a long story.",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx2.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for _ in response.iter_lines():
            if stop.is_set():
                return


def test_the_api_port_serves_live_queue_and_kv_gauges_while_requests_run(
    server: RouterFacingServer,
):
    stop = threading.Event()
    streams = [
        threading.Thread(target=stream_until, args=(server.url, stop)) for _ in range(STREAMS)
    ]
    for thread in streams:
        thread.start()
    try:

        def busy() -> str | None:
            text = server.metrics()
            running = gauge(text, "radixserve_num_requests_running")
            waiting = gauge(text, "radixserve_num_requests_waiting")
            kv = gauge(text, "radixserve_kv_usage_ratio")
            return text if running > 0 and waiting > 0 and kv > 0 else None

        text = wait_until(busy, 60, "running, waiting and KV usage above 0 on the API port")
    finally:
        stop.set()
        for thread in streams:
            thread.join(60)
    assert gauge(text, "radixserve_num_requests_running") <= MAX_RUNNING
    config = [
        s.labels
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "radixserve_cache_config_info"
    ]
    assert len(config) == 1 and {"page_size", "num_pages"} <= set(config[0]), config
    assert int(config[0]["num_pages"]) * int(config[0]["page_size"]) >= 4096
    assert "radixserve_requests_total" in family_names(text)  # the tokenizer's own
    names = family_names(text)
    assert len(names) == len(set(names)), "a family appears twice on the API port"
    with httpx2.Client(base_url=server.url) as http:
        wait_until(lambda: all_kv_free(http), 60, "the aborted streams to give back their KV")


def test_each_family_is_scraped_from_one_port_of_the_service_monitor(server: RouterFacingServer):
    monitor = helm_template(sets={"metrics.serviceMonitor.enabled": True}).one("ServiceMonitor")
    scraped = [endpoint["port"] for endpoint in monitor["spec"]["endpoints"]]
    assert set(scraped) <= set(SCRAPED_PORT_FLAGS), f"a port this test cannot map: {scraped}"
    served = {port: set(family_names(server.metrics(SCRAPED_PORT_FLAGS[port]))) for port in scraped}
    twice = {
        name: [port for port in scraped if name in served[port]]
        for name in set().union(*served.values())
        if sum(name in served[port] for port in scraped) > 1
    }
    assert not twice, f"families scraped from two ports: {twice}"
    worker = set(family_names(server.metrics("worker-metrics-port")))
    assert worker, "the worker serves its families"
    uncovered = sorted(name for name in worker if not any(name in served[p] for p in scraped))
    assert not uncovered, f"worker families no scraped port serves: {uncovered}"
