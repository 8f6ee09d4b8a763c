"""One finished span as a line of a trace file (``joynexus up --trace-file FILE``).

Every role appends the spans it ends to the same file, one JSON object per line (written by
:class:`bus.tracing.JsonLinesSpanExporter`); ``joynexus trace TENANT JOB`` reads them back
and draws a job's trace. Not a bus message: spans leave a process through an exporter, never
over NATS (the bus only carries W3C trace context in headers).
"""

from __future__ import annotations

from typing import Literal

import msgspec

#: An OpenTelemetry attribute's value (a list holds values of one type).
AttributeValue = str | bool | int | float | list[str | bool | int | float]

SpanKindName = Literal["internal", "server", "client", "producer", "consumer"]


class SpanLink(msgspec.Struct, frozen=True):
    """A span this one is linked to (not its parent): e.g. each request a grouped forward
    served, each in its own job's trace."""

    trace_id: str
    span_id: str


class SpanRecord(msgspec.Struct, frozen=True):
    """A finished span. Ids are lower-case hex as in W3C ``traceparent`` (trace 32 digits,
    span 16); times are Unix epoch nanoseconds."""

    trace_id: str
    span_id: str
    name: str
    #: The process's ``service.name`` (``joynexus-trainer``, ``joynexus-client``...).
    service: str
    start_ns: int
    end_ns: int
    #: Empty for a trace's root.
    parent_span_id: str = ""
    kind: SpanKindName = "internal"
    #: ``ok``, ``error`` or ``unset`` (OpenTelemetry's status codes).
    status: str = "unset"
    #: The error's description when ``status`` is ``error``.
    status_message: str = ""
    attributes: dict[str, AttributeValue] = msgspec.field(default_factory=dict)
    links: list[SpanLink] = msgspec.field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9


SPAN_RECORD_DECODER = msgspec.json.Decoder(SpanRecord)
SPAN_RECORD_ENCODER = msgspec.json.Encoder()
