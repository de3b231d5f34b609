"""A real Prometheus scrapes the three processes through shared-prefix traffic and a burst
that forces retractions; then the dashboard must show data everywhere."""

from __future__ import annotations

import httpx2
import pytest

from tests.observability.conftest import MODEL, SHARED_MAX_TOKENS, System
from tests.observability.dashboard import (
    hybrid_only,
    label_values_as_promql,
    panel_queries,
    panel_query,
    rule_expressions,
    substitute,
    variable_queries,
)

pytestmark = pytest.mark.timeout(300)


def test_every_dashboard_panel_query_returns_data(system: System):
    """But the sliding-window series', which this system's model (one KV pool) does not
    have: `test_swa_metrics.py` checks them on a hybrid model."""
    prometheus = system.require_prometheus()
    empty = [
        (title, ref)
        for title, ref, expr in panel_queries()
        if not hybrid_only(expr) and not prometheus.query(substitute(expr, MODEL))
    ]
    assert not empty, f"panel queries without data: {empty}"


def test_dashboard_variables_list_the_model_and_both_scraped_ports(system: System):
    prometheus = system.require_prometheus()
    values = {}
    for name, query in variable_queries().items():
        promql, label = label_values_as_promql(substitute(query, MODEL))
        values[name] = {series["metric"][label] for series in prometheus.query(promql)}
    assert values["model_name"] == {MODEL}
    # The worker's series come through the API port, so the worker is no instance of its own.
    scraped = (system.metrics_urls[role] for role in ("tokenizer", "detokenizer"))
    assert values["instance"] == {url.split("/")[2] for url in scraped}


def test_hit_rate_from_the_counters_is_above_zero(system: System):
    prometheus = system.require_prometheus()
    assert prometheus.value(substitute(panel_query("Prefix cache hit rate"), MODEL)) > 0
    assert prometheus.value(f'radixserve_cache_hit_rate{{model_name="{MODEL}"}}') > 0


def test_the_burst_on_a_small_kv_pool_shows_retractions(system: System):
    prometheus = system.require_prometheus()
    assert prometheus.value(substitute(panel_query("Retractions"), MODEL)) > 0
    assert prometheus.value("sum(radixserve_retracted_output_tokens_total)") > 0


def test_an_idle_system_holds_no_kv(system: System):
    """Idle means available + evictable == total: no slot is left held by a finished request."""
    prometheus = system.require_prometheus()
    assert prometheus.value(f'radixserve_kv_usage_ratio{{model_name="{MODEL}"}}') == 0
    assert prometheus.value(f'radixserve_radix_protected_tokens{{model_name="{MODEL}"}}') == 0
    assert prometheus.value(f'radixserve_radix_evictable_tokens{{model_name="{MODEL}"}}') > 0


def test_prometheus_loads_every_alert_rule_and_none_fires_after_a_healthy_run(system: System):
    prometheus = system.require_prometheus()
    groups = httpx2.get(f"{prometheus.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
    assert set(rules) == set(rule_expressions())
    assert all(rule["health"] == "ok" for rule in rules.values()), rules
    assert not [rule["name"] for rule in rules.values() if rule["state"] == "firing"]


def test_the_tokenizer_timed_every_request_as_its_client_saw_it(system: System):
    prometheus = system.require_prometheus()
    traffic = system.traffic
    requests = len(traffic["shared"]) + len(traffic["burst"]) + 1
    completion_tokens = (
        sum(r["usage"]["completion_tokens"] for r in traffic["burst"])
        + traffic["grammar"]["usage"]["completion_tokens"]
        + SHARED_MAX_TOKENS * len(traffic["shared"])
    )
    assert prometheus.value("sum(radixserve_time_to_first_token_seconds_count)") == requests
    assert prometheus.value("sum(radixserve_inter_token_latency_seconds_count)") > 0
    assert prometheus.value("sum(radixserve_request_generation_tokens_sum)") == completion_tokens
    assert prometheus.value("sum(radixserve_aborted_requests_total)") == 0
    assert (
        prometheus.value(
            'sum(radixserve_requests_total{endpoint="/v1/completions", outcome="success"})'
        )
        == requests
    )
