"""W3C trace context on message headers (OpenTelemetry).

Publishers inject the current span's ``traceparent``/``tracestate`` into the headers;
consumers extract it and start their span as a child, so one job is one trace from the
client's submit to its last event. Without an SDK configured this is the no-op API (cheap).
Note: nats-server >= 2.11 only treats ``traceparent`` as a server-side trace request when an
account enables message tracing (ADR-41); ours do not.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter

TRACER_NAME = "joynexus"


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Add the current trace context to ``headers`` (created if None) and return them."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract(headers: Mapping[str, str] | None) -> Context:
    """The trace context carried by a message's headers (empty context if none)."""
    return propagate.extract(dict(headers or {}))


@contextmanager
def consumer_span(name: str, headers: Mapping[str, str] | None) -> Iterator[trace.Span]:
    """A CONSUMER span continuing the trace of the message being handled."""
    with tracer().start_as_current_span(
        name, context=extract(headers), kind=trace.SpanKind.CONSUMER
    ) as span:
        yield span


def setup_tracing(service_name: str, exporter: SpanExporter | None = None) -> TracerProvider:
    """Install an SDK tracer provider for this process (once). With ``exporter`` None spans are
    recorded but not exported (enough for context propagation)."""
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider
