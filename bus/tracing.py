"""Tracing (OpenTelemetry): W3C trace context on message headers, spans, and their exporters.

Publishers inject the current span's ``traceparent``/``tracestate`` into the headers;
consumers extract it and start their span as a child, so one job is one trace from the
client's submit to its last event. Work that serves many messages at once (a trainer round,
a grouped backbone forward, an inferencer batch) is a span of its own with a **link** to each
message it served, and each message's part of it (a tenant's step) is a child in that
message's trace.

Exporters (:func:`setup_tracing`, once per process): a JSON-lines file that every role of a
stack appends to (``joynexus up --trace-file FILE``; ``joynexus trace`` reads it), the
console (``OTEL_TRACES_EXPORTER=console``), and OTLP when ``opentelemetry-exporter-otlp`` is
installed and an endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; the exporter reads the other standard ``OTEL_*``
variables itself). With none, spans are still made (context propagation needs them) but go
nowhere.

nats-server >= 2.11 treats a ``traceparent`` header as a request for its own message tracing
only when an account enables it (ADR-41: ``msg_trace``); ours do not, and must not, or every
published message would make the server publish trace events of its own.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import SpanKind, StatusCode

from schemas.headers import MSG_ID
from schemas.trace import SPAN_RECORD_ENCODER, AttributeValue, SpanLink, SpanRecord

if TYPE_CHECKING:
    from nats.aio.msg import Msg

log = logging.getLogger(__name__)

TRACER_NAME = "joynexus"

#: The attributes that tie a span to a tenant's job (``joynexus trace`` finds a job by them).
TENANT = "joynexus.tenant"
JOB = "joynexus.job"

#: How long a stopping process waits for its last spans to be written.
SHUTDOWN_TIMEOUT_S = 0.5


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


def job_attributes(tenant: str, job_id: str) -> dict[str, AttributeValue]:
    return {TENANT: tenant, JOB: job_id}


def tag_job(tenant: str, job_id: str) -> None:
    """Say on the current span which tenant's job it serves."""
    trace.get_current_span().set_attributes(job_attributes(tenant, job_id))


def messaging_attributes(msg: Msg, batch_count: int | None = None) -> dict[str, AttributeValue]:
    """OpenTelemetry's messaging semantic-convention attributes of a received message."""
    attributes: dict[str, AttributeValue] = {
        "messaging.system": "nats",
        "messaging.destination.name": msg.subject,
        "messaging.operation.type": "process",
    }
    message_id = (msg.headers or {}).get(MSG_ID)
    try:
        metadata = msg.metadata
    except Exception:  # noqa: BLE001 - a core NATS message has no JetStream metadata
        metadata = None
    if metadata is not None:
        attributes["messaging.consumer.group.name"] = metadata.consumer or ""
        attributes["messaging.nats.stream.sequence"] = metadata.sequence.stream
        message_id = message_id or f"{metadata.stream}:{metadata.sequence.stream}"
    if message_id:
        attributes["messaging.message.id"] = message_id
    if batch_count is not None:
        attributes["messaging.batch.message_count"] = batch_count
    return attributes


@contextmanager
def consumer_span(
    name: str,
    headers: Mapping[str, str] | None,
    attributes: Mapping[str, AttributeValue] | None = None,
    kind: SpanKind = SpanKind.CONSUMER,
) -> Iterator[trace.Span]:
    """A span continuing the trace of the message being handled (CONSUMER by default;
    SERVER for a request answered)."""
    with tracer().start_as_current_span(
        name, context=extract(headers), kind=kind, attributes=attributes
    ) as span:
        yield span


def link_to(headers: Mapping[str, str] | None) -> trace.Link | None:
    """A link to the span that sent a message (None if it carried no trace context)."""
    context = trace.get_current_span(extract(headers)).get_span_context()
    return trace.Link(context) if context.is_valid else None


def span_between(
    name: str,
    start_ns: int,
    end_ns: int,
    *,
    context: Context | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
    links: Sequence[trace.Link] = (),
    error: str | None = None,
) -> trace.Span:
    """A span of work already done (e.g. a phase timed inside a worker thread), ended at
    ``end_ns``; ``context`` its parent (default: the current span); ``error`` marks it failed."""
    span = tracer().start_span(
        name, context=context, attributes=attributes, links=list(links), start_time=start_ns
    )
    if error is not None:
        span.set_status(StatusCode.ERROR, error)
    span.end(end_time=max(start_ns, end_ns))
    return span


# -- exporters -------------------------------------------------------------------------------
class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span to ``path`` as one JSON line (:class:`SpanRecord`).

    Several processes append to the same file: each export is one ``write`` on a descriptor
    opened with ``O_APPEND``, so their lines never interleave. After :meth:`shutdown` it
    writes nothing."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = b"".join(SPAN_RECORD_ENCODER.encode(span_record(s)) + b"\n" for s in spans)
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                os.write(self._fd, data)
            except OSError as exc:
                log.warning("trace file %s: %s", self.path, exc)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


_KINDS = {
    SpanKind.INTERNAL: "internal",
    SpanKind.SERVER: "server",
    SpanKind.CLIENT: "client",
    SpanKind.PRODUCER: "producer",
    SpanKind.CONSUMER: "consumer",
}
_STATUS = {StatusCode.UNSET: "unset", StatusCode.OK: "ok", StatusCode.ERROR: "error"}


def span_record(span: ReadableSpan) -> SpanRecord:
    """What a trace file keeps of a finished SDK span."""
    context = span.get_span_context()
    assert context is not None
    parent = span.parent
    service = span.resource.attributes.get("service.name", "")
    return SpanRecord(
        trace_id=f"{context.trace_id:032x}",
        span_id=f"{context.span_id:016x}",
        name=span.name,
        service=str(service),
        start_ns=span.start_time or 0,
        end_ns=span.end_time or span.start_time or 0,
        parent_span_id=f"{parent.span_id:016x}" if parent is not None else "",
        kind=_KINDS.get(span.kind, "internal"),  # type: ignore[arg-type]
        status=_STATUS.get(span.status.status_code, "unset"),
        status_message=span.status.description or "",
        attributes={k: _plain(v) for k, v in (span.attributes or {}).items()},
        links=[
            SpanLink(f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}")
            for link in span.links
        ],
    )


def _plain(value: Any) -> AttributeValue:
    return list(value) if isinstance(value, tuple) else value


def exporters_from_environment(environ: Mapping[str, str]) -> list[SpanExporter]:
    """The exporters the standard ``OTEL_*`` variables ask for: ``console`` in
    ``OTEL_TRACES_EXPORTER``, and OTLP when an OTLP endpoint is set (unless
    ``OTEL_TRACES_EXPORTER`` says ``none`` or leaves ``otlp`` out)."""
    wanted = {
        name.strip()
        for name in environ.get("OTEL_TRACES_EXPORTER", "").lower().split(",")
        if name.strip()
    }
    exporters: list[SpanExporter] = []
    if "console" in wanted:
        exporters.append(ConsoleSpanExporter())
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if endpoint and (not wanted or "otlp" in wanted):
        otlp = _otlp_exporter(environ)
        if otlp is not None:
            exporters.append(otlp)
    return exporters


def _otlp_exporter(environ: Mapping[str, str]) -> SpanExporter | None:
    """OTLP over HTTP (the default protocol) or gRPC, to the endpoint ``environ`` names (the
    exporter reads its other ``OTEL_EXPORTER_OTLP_*`` settings, headers and timeouts, from the
    process's environment itself)."""
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    signal_endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base_endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            return GrpcExporter(endpoint=signal_endpoint or base_endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        # As the specification says: the generic endpoint gets the signal's path appended,
        # the per-signal one is used as it is.
        return HttpExporter(endpoint=signal_endpoint or base_endpoint.rstrip("/") + "/v1/traces")
    except ImportError:
        package = "grpc" if protocol == "grpc" else "http"
        log.warning(
            "an OTLP endpoint is set but opentelemetry-exporter-otlp-proto-%s is not "
            "installed: no spans are sent there",
            package,
        )
        return None


def setup_tracing(
    service_name: str,
    exporter: SpanExporter | None = None,
    *,
    trace_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> TracerProvider:
    """Make spans of this process go to ``exporter``, the JSON-lines ``trace_file`` and what
    the ``OTEL_*`` variables of ``environ`` ask for (:func:`exporters_from_environment`).

    The first call installs the SDK tracer provider (named ``service_name``); later calls add
    their exporters to it (OpenTelemetry allows one provider per process)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        # No shutdown at exit: an OTLP collector that does not answer would hold the exit up
        # for its retries; a role flushes once on its way out (flush_tracing).
        provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}), shutdown_on_exit=False
        )
        trace.set_tracer_provider(provider)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    batched: list[SpanExporter] = []
    if trace_file is not None:
        batched.append(JsonLinesSpanExporter(trace_file))
    if environ is not None:
        batched.extend(exporters_from_environment(environ))
    for each in batched:
        provider.add_span_processor(BatchSpanProcessor(each, schedule_delay_millis=500))
    return provider


def flush_tracing(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Write out the spans still queued, waiting at most ``timeout_s`` (an OTLP collector
    that does not answer must not hold up a stop)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush(timeout_millis=int(timeout_s * 1000))
