"""The LoRA metrics of the worker's collector: the Gateway API Inference Extension's
`lora_requests_info` gauge (adapter sets as labels, the time they last changed as value)
and the per-adapter request counts, on plain samples."""

from __future__ import annotations

import dataclasses
import time

from prometheus_client import CollectorRegistry

from observability.worker_metrics import WorkerMetrics
from tests.observability.test_worker_metrics import IDLE, value

INFO = "radixserve_lora_requests_info"


def info_labels(registry: CollectorRegistry) -> list[dict[str, str]]:
    return [
        sample.labels
        for family in registry.collect()
        if family.name == INFO
        for sample in family.samples
    ]


def test_the_info_gauge_carries_the_adapter_sets_and_the_time_they_changed():
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "m", max_lora=4)
    before = time.time()
    metrics.publish(dataclasses.replace(IDLE, running_lora_adapters=("a", "b")))
    (labels,) = info_labels(registry)
    assert labels["running_lora_adapters"] == "a,b" and labels["waiting_lora_adapters"] == ""
    assert labels["max_lora"] == "4"
    first = value(
        registry, INFO, **{k: v for k, v in labels.items() if k not in ("model_name", "tp_rank")}
    )
    assert first is not None and first >= before
    metrics.publish(dataclasses.replace(IDLE, time=1.0, running_lora_adapters=("a", "b")))
    assert metrics.lora_updated == first  # same sets: the value stays
    metrics.publish(dataclasses.replace(IDLE, time=2.0, waiting_lora_adapters=("c",)))
    (labels,) = info_labels(registry)
    assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == ("", "c")
    assert metrics.lora_updated >= first


def test_requests_are_counted_per_adapter():
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "m", max_lora=2)
    metrics.publish(IDLE)
    for name in ("a", "a", "b"):
        metrics.observe_lora_request(name)
    assert value(registry, "radixserve_lora_requests_total", lora_name="a") == 2
    assert value(registry, "radixserve_lora_requests_total", lora_name="b") == 1


def test_without_lora_serving_there_is_no_info_gauge():
    registry = CollectorRegistry()
    WorkerMetrics(registry, "m").publish(IDLE)
    assert info_labels(registry) == []
