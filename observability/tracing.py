"""OpenTelemetry tracing: one trace per request across the three processes.

The tokenizer opens the request's HTTP span and puts its W3C trace context in the
message to the worker; the worker adds queue-wait, prefill and decode spans and passes
the context on to the detokenizer, which adds a detokenize span. Worker and detokenizer
spans are recorded when the request finishes, from timestamps kept meanwhile, so tracing
adds nothing per token.

Tracing is on only when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set:
then spans leave in batches over OTLP/HTTP. Otherwise `setup_tracing` returns None and the
callers skip all tracing work.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_propagator = TraceContextTextMapPropagator()


class Tracing:
    """A tracer with the helpers the services need; one per process."""

    def __init__(self, provider: TracerProvider):
        self.provider = provider
        self.tracer = provider.get_tracer("radixserve")
        # Span times are wall-clock; the services keep monotonic times (immune to clock steps).
        self.wall_offset_ns = time.time_ns() - time.monotonic_ns()

    def carrier(self) -> dict[str, str]:
        """The current span's context as W3C headers (`traceparent`, `tracestate`)."""
        carrier: dict[str, str] = {}
        _propagator.inject(carrier)
        return carrier

    @staticmethod
    def extract(carrier: Mapping[str, str]) -> Context:
        return _propagator.extract(carrier)

    @contextlib.contextmanager
    def span(self, name: str, **attributes: str | int | float) -> Iterator[Span]:
        """A child of the current span, current while the block runs."""
        with self.tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def server_span(
        self, name: str, headers: Mapping[str, str]
    ) -> contextlib.AbstractContextManager[Span]:
        """The root of a request's trace in this service, or a child of the caller's
        `traceparent` header if it sent one."""
        return self.tracer.start_as_current_span(
            name, context=self.extract(headers), kind=SpanKind.SERVER
        )

    def record(
        self,
        name: str,
        carrier: Mapping[str, str],
        start: float,
        end: float,
        error: str | None = None,
        **attributes: str | int | float,
    ) -> None:
        """A finished span, child of `carrier`'s context, from `start` to `end` (time.monotonic()).
        Nothing without a `traceparent`: a request nobody traced gets no orphan spans."""
        if "traceparent" not in carrier:
            return
        span = self.tracer.start_span(
            name,
            context=self.extract(carrier),
            attributes=attributes,
            start_time=self._wall_ns(start),
        )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self._wall_ns(end))

    def shutdown(self) -> None:
        """Export what is still buffered; call once, at exit."""
        self.provider.shutdown()

    def _wall_ns(self, monotonic_s: float) -> int:
        return self.wall_offset_ns + int(monotonic_s * 1e9)


def setup_tracing(role: str, env: Mapping[str, str] = os.environ) -> Tracing | None:
    """Tracing for the `role` process if an OTLP endpoint is configured, else None."""
    if not any(env.get(name) for name in ENDPOINT_VARIABLES):
        return None
    # Imported only when used: the exporter pulls in protobuf and requests.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    resource = Resource.create(
        {"service.name": f"radixserve-{role}", "service.namespace": "radixserve"}
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    logger.info(
        "exporting traces over OTLP/HTTP to %s",
        next(env[n] for n in ENDPOINT_VARIABLES if env.get(n)),
    )
    return Tracing(provider)


def maybe_span(
    tracing: Tracing | None, name: str, **attributes: str | int | float
) -> contextlib.AbstractContextManager:
    """`tracing.span(name)`, or nothing at all when tracing is off."""
    return contextlib.nullcontext() if tracing is None else tracing.span(name, **attributes)
