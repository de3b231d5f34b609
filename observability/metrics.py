"""The tokenizer's Prometheus metrics. Every metric lives on a registry passed in, never
on the global one, so two servers or engines in one process never collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    7.5,
    10,
    20,
    40,
    80,
    160,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1,
    2.5,
    5,
)
E2E_BUCKETS = (
    0.1,
    0.25,
    0.5,
    1,
    1.5,
    2,
    2.5,
    5,
    10,
    15,
    20,
    30,
    40,
    50,
    60,
    120,
    240,
    480,
    960,
    1920,
)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def status_outcome(status: int) -> str:
    """A low-cardinality outcome label from an HTTP status."""
    if status < 400:
        return "success"
    return "client_error" if status < 500 else "server_error"


class TokenizerMetrics:
    """What the tokenizer process exports on its `/metrics`: HTTP requests, per generation
    request its latencies and lengths as the client saw them, and the scrapes that could not
    add the worker's series (`services.tokenizer.worker_metrics_proxy`)."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.registry = registry
        self.model_name = model_name
        self.requests = Counter(
            "radixserve_requests",
            "HTTP requests answered, by endpoint and outcome (success, client_error, server_error)",
            ["model_name", "endpoint", "outcome"],
            registry=registry,
        )
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=registry, buckets=buckets).labels(
                model_name
            )

        self.time_to_first_token = histogram(
            "radixserve_time_to_first_token_seconds",
            "Seconds from submission to the first output token",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "radixserve_inter_token_latency_seconds",
            "Seconds between output tokens (each output's gap / its tokens)",
            ITL_BUCKETS,
        )
        self.e2e_latency = histogram(
            "radixserve_e2e_request_latency_seconds",
            "Seconds from submission to the last output",
            E2E_BUCKETS,
        )
        self.prompt_length = histogram(
            "radixserve_request_prompt_tokens", "Prompt tokens per finished request", LENGTH_BUCKETS
        )
        self.completion_length = histogram(
            "radixserve_request_generation_tokens",
            "Generated tokens per finished request",
            LENGTH_BUCKETS,
        )
        self.aborted = Counter(
            "radixserve_aborted_requests",
            "Generation requests that ended in an abort (client gone, refused, failed)",
            labels,
            registry=registry,
        ).labels(model_name)
        self.worker_scrape_failures = Counter(
            "radixserve_worker_metrics_scrape_failures",
            "Scrapes of this /metrics that came without the worker's series: the worker's "
            "/metrics did not answer 200 within the timeout",
            labels,
            registry=registry,
        ).labels(model_name)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(self.model_name, endpoint, status_outcome(status)).inc()


class RequestTimer:
    """One generation request's clock in the tokenizer, from submission to its last output."""

    def __init__(self, metrics: TokenizerMetrics, submitted: float):
        self.metrics = metrics
        self.submitted = submitted
        self.last_token: float | None = None

    def tokens(self, now: float, count: int) -> None:
        """`count` new output tokens arrived at `now` (time.monotonic())."""
        if count <= 0:
            return
        if self.last_token is None:
            self.metrics.time_to_first_token.observe(now - self.submitted)
        else:
            self.metrics.inter_token_latency.observe((now - self.last_token) / count)
        self.last_token = now

    def finish(self, now: float, prompt_tokens: int, completion_tokens: int) -> None:
        self.metrics.e2e_latency.observe(now - self.submitted)
        self.metrics.prompt_length.observe(prompt_tokens)
        self.metrics.completion_length.observe(completion_tokens)
