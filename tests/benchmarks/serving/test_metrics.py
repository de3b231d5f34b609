"""Percentiles, summaries and /metrics counters: the arithmetic behind every figure."""

from __future__ import annotations

import random

import numpy as np
import pytest

from benchmarks.serving.metrics import (
    HIT_TOKENS,
    QUERY_TOKENS,
    LatencyStats,
    RequestResult,
    cache_counters,
    cpu_info,
    hit_rate,
    percentile,
    summarize,
)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_percentile_matches_numpys_linear_interpolation(n: int):
    rng = random.Random(n)
    values = sorted(rng.uniform(0, 100) for _ in range(n))
    for p in (0, 1, 50, 90, 99, 100):
        assert percentile(values, p) == pytest.approx(np.percentile(values, p))


def test_percentile_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        percentile([], 50)


def test_latency_stats_are_milliseconds_and_empty_is_none():
    stats = LatencyStats.of([0.001, 0.002, 0.003, 0.004])
    assert stats.mean == pytest.approx(2.5) and stats.p50 == pytest.approx(2.5)
    assert stats.p99 == pytest.approx(3.97)
    assert LatencyStats.of([]) == LatencyStats(None, None, None, None)


def test_tpot_spreads_the_time_after_the_first_token_over_the_remaining_tokens():
    assert RequestResult(prompt_len=1, output_len=5, ttft=0.2, latency=1.0).tpot == pytest.approx(
        0.2
    )
    assert RequestResult(prompt_len=1, output_len=1, ttft=0.2, latency=0.2).tpot is None
    assert RequestResult(prompt_len=1, error="timeout").tpot is None


def test_summary_counts_only_completed_requests_and_groups_errors_by_kind():
    results = [
        RequestResult(
            prompt_len=100, output_len=10, ttft=0.1, itls=[0.05] * 9, latency=0.55, cached_tokens=60
        ),
        RequestResult(
            prompt_len=300, output_len=10, ttft=0.3, itls=[0.1] * 9, latency=1.2, cached_tokens=0
        ),
        RequestResult(prompt_len=50, error="http_503"),
        RequestResult(prompt_len=50, error="http_503"),
        RequestResult(prompt_len=50, output_len=3, error="wrong_output_len"),
    ]
    s = summarize(results, duration_s=2.0, radix_hit_rate=0.25)
    assert (s.completed, s.failed) == (2, 3)
    assert s.errors == {"http_503": 2, "wrong_output_len": 1}
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(10.0)
    assert s.total_throughput == pytest.approx((400 + 20) / 2)
    assert s.ttft_ms.p50 == pytest.approx(200)
    assert s.itl_ms.mean == pytest.approx(75)
    assert s.tpot_ms.p50 == pytest.approx((0.45 / 9 + 0.9 / 9) / 2 * 1000)
    assert s.e2e_ms.p90 == pytest.approx(550 + 0.9 * 650)
    assert s.cached_prompt_fraction == pytest.approx(60 / 400)
    assert s.radix_hit_rate == 0.25


def test_a_peer_without_usage_has_no_cached_fraction():
    s = summarize([RequestResult(prompt_len=10, output_len=2, ttft=0.1, latency=0.2)], 1.0)
    assert s.cached_prompt_fraction is None and s.radix_hit_rate is None


METRICS = f"""\
# HELP radixserve_requests_total HTTP requests answered
# TYPE radixserve_requests_total counter
radixserve_requests_total{{endpoint="/v1/completions",outcome="success"}} 7.0
# HELP {HIT_TOKENS[:-6]} Prompt tokens served from the radix cache
# TYPE {HIT_TOKENS[:-6]} counter
{HIT_TOKENS}{{model_name="a"}} 30.0
{HIT_TOKENS}{{model_name="b"}} 10.0
# HELP {QUERY_TOKENS[:-6]} Prompt tokens looked up in the radix cache
# TYPE {QUERY_TOKENS[:-6]} counter
{QUERY_TOKENS}{{model_name="a"}} 100.0
"""


def test_cache_counters_sum_over_labels():
    assert cache_counters(METRICS) == (40.0, 100.0)


def test_cache_counters_are_none_when_the_server_does_not_export_them():
    assert cache_counters(METRICS.split(f"# HELP {QUERY_TOKENS[:-6]}")[0]) is None
    assert cache_counters("") is None


def test_hit_rate_is_the_delta_between_scrapes():
    assert hit_rate((40.0, 100.0), (70.0, 200.0)) == pytest.approx(0.3)
    assert hit_rate(None, (70.0, 200.0)) is None
    assert hit_rate((40.0, 100.0), None) is None
    assert hit_rate((40.0, 100.0), (40.0, 100.0)) is None


def test_forward_time_is_read_per_mode_and_its_quantile_interpolated_within_buckets():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from benchmarks.serving.metrics import forward_time

    registry = CollectorRegistry()
    hist = Histogram(
        "radixserve_forward_time_seconds",
        "forward",
        ["mode"],
        registry=registry,
        buckets=(0.01, 0.025, 0.05),
    )
    for seconds in (0.02, 0.02, 0.03, 0.04):
        hist.labels("decode").observe(seconds)
    hist.labels("extend").observe(1.0)
    before = forward_time(generate_latest(registry).decode())
    assert before is not None and before.count == 4
    hist.labels("decode").observe(0.005)
    hist.labels("decode").observe(0.005)
    delta = forward_time(generate_latest(registry).decode()) - before
    assert (delta.count, delta.mean) == (2, pytest.approx(0.005))
    assert delta.quantile(0.5) == pytest.approx(0.005)  # half-way into the (0, 10 ms] bucket
    assert before.quantile(0.5) == pytest.approx(0.01 + 0.015 * 2 / 2)  # 2 of the 2 in (10, 25]
    assert forward_time("") is None


def test_cpu_info_reads_the_gauges_labels_and_none_from_another_server():
    text = (
        "# HELP radixserve_cpu_info What runs the model\n"
        "# TYPE radixserve_cpu_info gauge\n"
        'radixserve_cpu_info{dtype="float32",isa="avx2",weights="gguf:Q4_1"} 1.0\n'
    )
    assert cpu_info(text) == {"dtype": "float32", "isa": "avx2", "weights": "gguf:Q4_1"}
    assert cpu_info("# TYPE other gauge\nother 1.0\n") is None
