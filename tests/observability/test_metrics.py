from prometheus_client import CollectorRegistry, generate_latest

from observability.metrics import RequestTimer, TokenizerMetrics, status_outcome


def test_two_metric_sets_in_one_process_do_not_collide():
    a, b = (
        TokenizerMetrics(CollectorRegistry(), "m-a"),
        TokenizerMetrics(CollectorRegistry(), "m-b"),
    )
    a.count_request("/v1/completions", 200)
    b.count_request("/v1/completions", 503)
    assert b'model_name="m-a"' in generate_latest(a.registry) and b"m-b" not in generate_latest(
        a.registry
    )
    assert b'outcome="server_error"' in generate_latest(b.registry)


def test_outcome_follows_the_status_class():
    assert [status_outcome(s) for s in (200, 299, 400, 429, 500, 503)] == [
        "success",
        "success",
        "client_error",
        "client_error",
        "server_error",
        "server_error",
    ]


def test_request_timer_observes_first_token_once_then_the_gap_per_token():
    metrics = TokenizerMetrics(CollectorRegistry(), "m")
    timer = RequestTimer(metrics, submitted=10.0)
    timer.tokens(10.5, 1)
    timer.tokens(10.6, 0)  # an output without new tokens (only text held back before) is no gap
    timer.tokens(11.1, 3)
    timer.finish(11.1, prompt_tokens=7, completion_tokens=4)

    def observed(name: str) -> tuple[float, float]:
        labels = {"model_name": "m"}
        return (
            metrics.registry.get_sample_value(f"{name}_count", labels),
            round(metrics.registry.get_sample_value(f"{name}_sum", labels), 6),
        )

    assert observed("radixserve_time_to_first_token_seconds") == (1, 0.5)
    assert observed("radixserve_inter_token_latency_seconds") == (1, 0.2)
    assert observed("radixserve_e2e_request_latency_seconds") == (1, 1.1)
    assert observed("radixserve_request_prompt_tokens") == (1, 7)
    assert observed("radixserve_request_generation_tokens") == (1, 4)
