"""``joynexus trace TENANT JOB``: one job's trace from a trace file, as a waterfall.

The roles of a stack started with ``joynexus up --trace-file FILE`` append their finished
spans to FILE (:class:`bus.tracing.JsonLinesSpanExporter`). A job's spans are the traces
holding a span tagged with its tenant and job (a job started later from the queue begins a
trace of its own, so there can be several), plus the shared work linked to them: a trainer
round or an inferencer batch that served the job among others is a trace of its own, with a
link to each message it served, and is drawn under the span it links to, marked ``⇠``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from bus.tracing import JOB, TENANT
from schemas.trace import SPAN_RECORD_DECODER, SpanRecord

#: Attributes worth a word on a waterfall row, in this order.
_SHOWN = (
    ("joynexus.step", "step"),
    ("joynexus.iteration", "iteration"),
    ("joynexus.episode", "episode"),
    ("joynexus.loss", "loss"),
    ("joynexus.return", "return"),
    ("joynexus.success", "success"),
    ("joynexus.samples", "samples"),
    ("joynexus.observations", "obs"),
    ("messaging.batch.message_count", "messages"),
    ("joynexus.version", "version"),
)


@dataclass
class SpanFile:
    """The spans a trace file holds, and how many of its lines could not be read (a line cut
    short by a process killed mid-write)."""

    spans: list[SpanRecord]
    unreadable: int = 0


def read_spans(path: Path) -> SpanFile:
    spans: list[SpanRecord] = []
    unreadable = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                spans.append(SPAN_RECORD_DECODER.decode(line))
            except msgspec.DecodeError:
                unreadable += 1
    return SpanFile(spans, unreadable)


@dataclass
class Row:
    span: SpanRecord
    depth: int
    #: Drawn because it links to a span of the job (shared work), not as a child.
    linked: bool = False


@dataclass
class JobTrace:
    tenant: str
    job_id: str
    trace_ids: list[str]
    rows: list[Row] = field(default_factory=list)

    @property
    def spans(self) -> list[SpanRecord]:
        return [r.span for r in self.rows]


def job_trace(spans: Sequence[SpanRecord], tenant: str, job_id: str) -> JobTrace:
    """The rows of the job's waterfall: each of its traces as a tree in time order, with the
    shared work that links to one of its spans under that span."""
    trace_ids = sorted(
        {
            s.trace_id
            for s in spans
            if s.attributes.get(TENANT) == tenant and s.attributes.get(JOB) == job_id
        },
        key=lambda t: min(s.start_ns for s in spans if s.trace_id == t),
    )
    mine = set(trace_ids)
    children: dict[tuple[str, str], list[SpanRecord]] = defaultdict(list)
    by_id: dict[tuple[str, str], SpanRecord] = {}
    for s in spans:
        by_id[(s.trace_id, s.span_id)] = s
    for s in spans:
        if s.parent_span_id and (s.trace_id, s.parent_span_id) in by_id:
            children[(s.trace_id, s.parent_span_id)].append(s)
    # Shared work: a span of another trace linking to one of the job's spans, drawn under
    # the first such span (with its own subtree).
    linked_to: dict[tuple[str, str], list[SpanRecord]] = defaultdict(list)
    for s in spans:
        if s.trace_id in mine:
            continue
        for link in s.links:
            if link.trace_id in mine and (link.trace_id, link.span_id) in by_id:
                linked_to[(link.trace_id, link.span_id)].append(s)
                break
    result = JobTrace(tenant, job_id, trace_ids)
    drawn: set[tuple[str, str]] = set()

    def walk(span: SpanRecord, depth: int, linked: bool) -> None:
        key = (span.trace_id, span.span_id)
        if key in drawn:
            return
        drawn.add(key)
        result.rows.append(Row(span, depth, linked))
        below = [(c, False) for c in children[key]] + [(c, True) for c in linked_to[key]]
        for child, is_link in sorted(below, key=lambda c: c[0].start_ns):
            walk(child, depth + 1, linked or is_link)

    for trace_id in trace_ids:
        roots = [
            s
            for s in spans
            if s.trace_id == trace_id
            and not (s.parent_span_id and (trace_id, s.parent_span_id) in by_id)
        ]
        for root in sorted(roots, key=lambda s: s.start_ns):
            walk(root, 0, False)
    return result


def _facts(span: SpanRecord) -> str:
    words = []
    for key, label in _SHOWN:
        value = span.attributes.get(key)
        if value is None:
            continue
        words.append(f"{label}={value:.4g}" if isinstance(value, float) else f"{label}={value}")
    if span.status == "error":
        words.append(f"ERROR {span.status_message}"[:120])
    return " ".join(words)


def render(job: JobTrace, width: int = 40, max_rows: int = 150) -> str:
    """The waterfall (at most ``max_rows`` rows) and a summary per span name."""
    if not job.rows:
        return f"no spans of job {job.tenant}/{job.job_id} in this file"
    t0 = min(s.start_ns for s in job.spans)
    t1 = max(s.end_ns for s in job.spans)
    total = max(1, t1 - t0)
    lines = [
        f"job {job.tenant}/{job.job_id}: {len(job.rows)} spans in {len(job.trace_ids)} "
        f"trace(s), {total / 1e9:.3f} s  (⇠ shared work linked to the job's spans)",
        f"{'start s':>8} {'took ms':>9}  {'':<{width + 2}}  span",
    ]
    for row in job.rows[:max_rows]:
        s = row.span
        first = int((s.start_ns - t0) / total * width)
        last = max(first + 1, math.ceil((s.end_ns - t0) / total * width))
        bar = " " * first + "█" * (min(width, last) - first)
        name = ("⇠ " if row.linked else "") + s.name
        service = s.service.removeprefix("joynexus-")
        lines.append(
            f"{(s.start_ns - t0) / 1e9:>8.3f} {(s.end_ns - s.start_ns) / 1e6:>9.1f}  "
            f"|{bar:<{width}}|  {'  ' * row.depth}{name} [{service}] {_facts(s)}".rstrip()
        )
    if len(job.rows) > max_rows:
        lines.append(f"... {len(job.rows) - max_rows} more spans (--max-spans to see them)")
    lines += ["", summary(job)]
    return "\n".join(lines)


def summary(job: JobTrace) -> str:
    """Count, total and mean time per (service, span name), the job's own ids in subject
    names written ``<tenant>`` and ``<job>``."""
    totals: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in job.rows:
        s = row.span
        name = s.name.replace(job.job_id, "<job>").replace(job.tenant, "<tenant>")
        totals[(s.service.removeprefix("joynexus-"), name)].append(s.duration_s)
    lines = [f"{'service':<11} {'span':<50} {'count':>6} {'total s':>9} {'mean ms':>9}"]
    for (service, name), took in sorted(totals.items(), key=lambda kv: -sum(kv[1])):
        lines.append(
            f"{service:<11} {name[:50]:<50} {len(took):>6} {sum(took):>9.3f} "
            f"{sum(took) / len(took) * 1e3:>9.1f}"
        )
    return "\n".join(lines)
