"""The detokenizer's Prometheus metrics: how much text work it does and how long it takes,
so a detokenizer that falls behind the worker shows up before clients notice."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

BATCH_TIME_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class DetokenizerMetrics:
    def __init__(
        self, registry: CollectorRegistry, model_name: str, live_requests: Callable[[], int]
    ):
        labels = ["model_name"]
        self.batches = Counter(
            "radixserve_detokenizer_batches",
            "Worker output batches turned into text",
            labels,
            registry=registry,
        ).labels(model_name)
        self.batch_time = Histogram(
            "radixserve_detokenizer_batch_time_seconds",
            "Seconds to detokenize one worker output batch",
            labels,
            registry=registry,
            buckets=BATCH_TIME_BUCKETS,
        ).labels(model_name)
        Gauge(
            "radixserve_detokenizer_live_requests",
            "Requests with incremental detokenizer state",
            labels,
            registry=registry,
        ).labels(model_name).set_function(live_requests)

    def observe_batch(self, seconds: float) -> None:
        self.batches.inc()
        self.batch_time.observe(seconds)
