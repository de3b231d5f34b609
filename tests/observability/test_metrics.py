from prometheus_client import CollectorRegistry, generate_latest

from observability.metrics import TokenizerMetrics, status_outcome


def test_two_metric_sets_in_one_process_do_not_collide():
    a, b = TokenizerMetrics(CollectorRegistry(), "m-a"), TokenizerMetrics(CollectorRegistry(), "m-b")
    a.count_request("/v1/completions", 200)
    b.count_request("/v1/completions", 503)
    assert b'model_name="m-a"' in generate_latest(a.registry) and b"m-b" not in generate_latest(a.registry)
    assert b'outcome="server_error"' in generate_latest(b.registry)


def test_outcome_follows_the_status_class():
    assert [status_outcome(s) for s in (200, 299, 400, 429, 500, 503)] == [
        "success", "success", "client_error", "client_error", "server_error", "server_error"]
