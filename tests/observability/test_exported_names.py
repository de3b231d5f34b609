"""Every metric the dashboard and the alert rules ask for is exported by a running system:
a renamed metric must not leave a panel or an alert silently empty."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from testing.launcher import ROLES
from tests.observability.conftest import System
from tests.observability.dashboard import hybrid_only, metric_names_used


def exported_sample_names(system: System) -> set[str]:
    """Sample names as Prometheus stores them: `_total`, `_bucket`, `_sum`, `_count` included."""
    return {
        sample.name
        for role in ROLES
        for family in text_string_to_metric_families(system.metrics_text(role))
        for sample in family.samples
    }


def test_every_metric_of_the_dashboard_and_the_rules_is_exported(system: System):
    """The sliding-window series aside: a hybrid model exports those
    (`test_swa_metrics.py`), and this system's model has one KV pool."""
    used = {name for name in metric_names_used() if not hybrid_only(name)}
    assert len(used) > 20  # the parse found the queries
    exported = exported_sample_names(system)
    missing = sorted(used - exported)
    assert not missing, f"used by the dashboard or the rules but not exported: {missing}"
    assert not [name for name in exported if hybrid_only(name)], "one pool: no SWA series"


def test_the_cache_scheduler_and_latency_metrics_are_exported_with_their_types(system: System):
    families = {
        family.name: family.type
        for role in ROLES
        for family in text_string_to_metric_families(system.metrics_text(role))
    }
    counters = (
        "prefix_cache_hit_tokens",
        "prefix_cache_query_tokens",
        "retracted_requests",
        "retracted_input_tokens",
        "retracted_output_tokens",
        "radix_evicted_tokens",
        "prompt_tokens",
        "generation_tokens",
        "spec_verify_steps",
        "spec_proposed_tokens",
        "spec_accepted_tokens",
    )
    gauges = (
        "cache_hit_rate",
        "new_token_ratio",
        "radix_evictable_tokens",
        "radix_protected_tokens",
        "kv_usage_ratio",
        "kv_total_tokens",
        "cache_config_info",
        "num_requests_running",
        "num_requests_waiting",
        "num_requests_grammar_queue",
    )
    histograms = (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "queue_time_seconds",
        "batch_size",
        "forward_time_seconds",
        "grammar_compile_time_seconds",
        "grammar_mask_time_seconds",
        "spec_accept_length",
    )
    expected = {
        **{n: "counter" for n in counters},
        **{n: "gauge" for n in gauges},
        **{n: "histogram" for n in histograms},
    }
    assert {name: families.get(f"radixserve_{name}") for name in expected} == expected
