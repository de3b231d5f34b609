"""A hybrid model's two KV pools on /metrics and on the dashboard, against the three real
processes serving a tiny random Gemma 3 (one sliding layer over 8 tokens, one global) with a
small sliding-window pool, scraped through the API port by a real Prometheus.

The traffic, in token ids, moves every sliding-window series: a first request's output
behind its window goes into the tree as SWA tombstones, and its prompt's window with them;
a second extends the first's prompt with the start of that output and hits the
full-attention KV of both, but reuses none of it (the window before a reused prefix's end
must be live, and the tree kept only the one before the first's end); a third extends the
second's prompt, whose window the tree kept, and streams while the scrape looks: the SWA
pool is then partly held and the tree's SWA KV partly locked; once it stops, both drop
back."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testing.launcher import ServiceLauncher, cpu_flags, server_ports
from testing.models import TINY_LLAMA_CONTEXT, TINY_SLIDING_WINDOW, save_tiny_model
from testing.net import all_kv_free, server_info, wait_until
from tests.observability.conftest import Prometheus, require_binary
from tests.observability.dashboard import (
    hybrid_only,
    metric_names_used,
    panel_queries,
    substitute,
)

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-gemma3"
PROMPT = list(range(1000, 1033))
FIRST_OUTPUT = 60
"""Its tokens behind the window are freed in one batch of 32 (`SWA_EVICTION_INTERVAL`)
before it finishes: they reach the tree as tombstones."""
SHARED_OUTPUT = 25


@dataclass
class HybridSystem:
    url: str
    prometheus: Prometheus

    def metrics(self) -> dict[tuple[str, str | None], float]:
        """The API port's samples (the worker's among them), by name and `pool` label."""
        text = httpx2.get(f"{self.url}/metrics", timeout=10).text
        return {
            (s.name, s.labels.get("pool")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


def generate(url: str, input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    reply = httpx2.post(f"{url}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def stream_until(url: str, input_ids: list[int], stop: threading.Event) -> None:
    """A long streamed generation, read until `stop` (leaving aborts it)."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        "stream": True,
    }
    with httpx2.stream("POST", f"{url}/generate", json=body, timeout=120) as reply:
        for _ in reply.iter_lines():
            if stop.is_set():
                return


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HybridSystem]:
    binary = require_binary("prometheus")
    model = save_tiny_model(
        tmp_path_factory.mktemp("tiny-gemma3"),
        "gemma3",
        tokenizer="embedded",
        max_position_embeddings=TINY_LLAMA_CONTEXT,
    )
    ports = server_ports()
    flags = [
        *cpu_flags(1800, model),  # 3272 full slots, 327 sliding-window ones
        "--swa-full-tokens-ratio",
        "0.1",
        "--served-model-name",
        MODEL,
    ]
    prometheus = Prometheus(
        binary,
        {"radixserve-tokenizer": f"127.0.0.1:{ports['port']}"},
        tmp_path_factory.mktemp("prometheus-hybrid"),
    )
    launcher = ServiceLauncher(tmp_path_factory.mktemp("hybrid-logs"), 1.0)
    try:
        with launcher.serve(flags, ports=ports) as url:
            yield HybridSystem(url, prometheus)
    finally:
        prometheus.close()


def test_the_sliding_window_series_move_with_the_traffic(hybrid: HybridSystem):
    url = hybrid.url
    with httpx2.Client(base_url=url) as http:
        info = server_info(http)
    idle = hybrid.metrics()
    assert idle["radixserve_swa_kv_total_tokens", None] == info["swa_max_total_tokens"] > 0
    assert idle["radixserve_kv_total_tokens", None] == info["max_total_tokens"]
    assert idle["radixserve_swa_kv_usage_ratio", None] == 0
    assert idle["radixserve_swa_prefix_cache_hit_tokens_total", "full"] == 0

    first = generate(url, PROMPT, FIRST_OUTPUT)["output_ids"]
    second = PROMPT + first[:SHARED_OUTPUT] + [2000, 2001, 2002]
    assert generate(url, second, 4)["meta_info"]["cached_tokens"] == 0
    stop = threading.Event()
    stream = threading.Thread(target=stream_until, args=(url, second + [3000, 3001], stop))
    stream.start()
    try:

        def busy() -> dict[tuple[str, str | None], float] | None:
            """A sample taken while the third request runs (it was admitted: its hit counts)."""
            now = hybrid.metrics()
            hits = now["radixserve_prefix_cache_hit_tokens_total", None]
            running = now["radixserve_num_requests_running", None] > 0
            return now if running and hits == len(second) else None

        running = wait_until(busy, 60, "a sample of the third request running")
    finally:
        stop.set()
        stream.join(60)
    with httpx2.Client(base_url=url) as http:
        wait_until(lambda: all_kv_free(http), 60, "both pools free or evictable again")

    def settled() -> dict[tuple[str, str | None], float] | None:
        """A sample taken since (the worker publishes one every 0.25 s)."""
        now = hybrid.metrics()
        return now if now["radixserve_num_requests_running", None] == 0 else None

    after = wait_until(settled, 30, "a sample of the idle server")

    assert running["radixserve_kv_usage_ratio", None] > 0
    assert running["radixserve_swa_kv_usage_ratio", None] > 0
    assert running["radixserve_radix_swa_protected_tokens", None] == TINY_SLIDING_WINDOW - 1
    assert after["radixserve_swa_kv_usage_ratio", None] == 0
    assert after["radixserve_radix_swa_protected_tokens", None] == 0
    assert after["radixserve_radix_swa_evictable_tokens", None] > 0
    full = after["radixserve_swa_prefix_cache_hit_tokens_total", "full"]
    reused = after["radixserve_swa_prefix_cache_hit_tokens_total", "swa"]
    assert reused == after["radixserve_prefix_cache_hit_tokens_total", None]
    assert (full, reused) == (len(PROMPT) + SHARED_OUTPUT + len(second), len(second))


def test_every_sliding_window_series_of_the_dashboard_is_exported_and_shows_data(
    hybrid: HybridSystem,
):
    generate(hybrid.url, PROMPT, 4)  # a hit, in case this test runs alone
    exported = {name for name, _ in hybrid.metrics()}
    used = {name for name in metric_names_used() if hybrid_only(name)}
    assert len(used) >= 5
    assert not sorted(used - exported), f"the dashboard's, not exported: {used - exported}"
    prometheus = hybrid.prometheus
    queries = [expr for _, _, expr in panel_queries() if hybrid_only(expr)]
    wait_until(
        lambda: all(prometheus.query(substitute(expr, MODEL)) for expr in queries),
        60,
        "Prometheus to answer every sliding-window panel query",
    )
