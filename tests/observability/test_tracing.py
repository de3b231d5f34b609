"""One trace per request across the three processes, exported over OTLP/HTTP to a small
receiver on 127.0.0.1; and no tracing at all without an endpoint."""

from __future__ import annotations

from collections import defaultdict

from observability.tracing import setup_tracing
from testing.launcher import ROLES
from testing.net import wait_until
from tests.observability.conftest import ReceivedSpan, System

SPANS = {
    "tokenizer": {"POST /v1/completions", "tokenize"},
    "worker": {"queue_wait", "prefill", "decode"},
    "detokenizer": {"detokenize"},
}


def complete_traces(system: System) -> list[list[ReceivedSpan]]:
    """The traces received so far that have every span of every process."""
    traces = defaultdict(list)
    for span in list(system.receiver.spans):
        traces[span.trace_id].append(span)
    expected = {(f"radixserve-{role}", name) for role, names in SPANS.items() for name in names}
    return [spans for spans in traces.values() if expected <= {(s.service, s.name) for s in spans}]


def test_each_request_is_one_trace_with_spans_from_all_three_processes(system: System):
    requests = sum(len(system.traffic[k]) for k in ("shared", "burst")) + 1
    wait_until(lambda: len(complete_traces(system)) >= requests, 30, f"{requests} complete traces")
    complete = complete_traces(system)
    assert len(complete) == requests
    for spans in complete:
        (root,) = [s for s in spans if s.name == "POST /v1/completions"]
        assert root.parent_span_id == ""
        # Every other span hangs off the request's HTTP span, whichever process made it.
        assert {s.parent_span_id for s in spans if s is not root} == {root.span_id}
        assert {s.service for s in spans} == {f"radixserve-{role}" for role in ROLES}


def test_tracing_is_off_without_an_otlp_endpoint():
    assert setup_tracing("worker", env={}) is None
    assert setup_tracing("worker", env={"OTEL_EXPORTER_OTLP_ENDPOINT": ""}) is None
