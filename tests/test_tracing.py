"""Tracing: the span file several processes append to, a job's waterfall, the OTLP exporter,
and one trace per job through a real stack (client, master, env worker, trainer,
inferencer as processes)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from bench.traces import job_trace, read_spans, render
from bus import tracing
from bus.server import EmbeddedServer
from clients.sdk import Client
from schemas.trace import SpanRecord
from tests.conftest import Procs
from tests.helpers import ROOT, eventually, joynexus, print_log_tails, start_service, uid
from tests.sft_helpers import OFT_2D, record_datasets, registered, sft_spec
from tests.test_rl import rl_spec

WRITER = """
import sys
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from bus.tracing import JsonLinesSpanExporter

provider = TracerProvider(resource=Resource.create({"service.name": sys.argv[2]}))
provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(sys.argv[1])))
tracer = provider.get_tracer("t")
for i in range(int(sys.argv[3])):
    with tracer.start_as_current_span(f"span {i}", attributes={"i": i, "pad": "x" * 300}):
        pass
provider.shutdown()
"""


def test_processes_appending_to_one_span_file_never_interleave_their_lines(
    tmp_path: Path,
) -> None:
    path = tmp_path / "spans.jsonl"
    count = 3000
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), f"w{n}", str(count)], cwd=ROOT)
        for n in range(3)
    ]
    assert [w.wait(120) for w in writers] == [0, 0, 0]
    spans = read_spans(path)
    assert spans.unreadable == 0
    for n in range(3):
        mine = sorted(int(s.attributes["i"]) for s in spans.spans if s.service == f"w{n}")
        assert mine == list(range(count))


def _provider(path: Path, service: str) -> tuple[TracerProvider, tracing.JsonLinesSpanExporter]:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = tracing.JsonLinesSpanExporter(path)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_a_job_waterfall_holds_its_trace_and_the_shared_work_linked_to_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "spans.jsonl"
    client, _ = _provider(path, "joynexus-client")
    trainer, _ = _provider(path, "joynexus-trainer")
    job = tracing.job_attributes("acme", "job-1")
    with client.get_tracer("t").start_as_current_span("submit", attributes=job):
        headers = tracing.inject()
    other_headers: dict[str, str] = {}
    with client.get_tracer("t").start_as_current_span(
        "submit", attributes=tracing.job_attributes("bob", "job-2")
    ):
        other_headers = tracing.inject()
    tracer = trainer.get_tracer("t")
    with tracer.start_as_current_span("train step", context=tracing.extract(headers)):
        pass
    # A round that served both jobs: its own trace, linked to each job's message.
    links = [tracing.link_to(headers), tracing.link_to(other_headers)]
    assert all(link is not None for link in links)
    with tracer.start_as_current_span(
        "trainer round",
        context=trace.set_span_in_context(trace.INVALID_SPAN),
        links=[link for link in links if link is not None],
    ):
        with tracer.start_as_current_span("backbone forward"):
            pass
    spans = read_spans(path).spans
    assert len(spans) == 5
    drawn = job_trace(spans, "acme", "job-1")
    names = [(r.span.name, r.depth, r.linked) for r in drawn.rows]
    assert names == [
        ("submit", 0, False),
        ("train step", 1, False),
        ("trainer round", 1, True),
        ("backbone forward", 2, True),
    ]
    text = render(drawn)
    assert "⇠ trainer round [trainer]" in text and "█" in text
    assert "bob" not in text and len(drawn.trace_ids) == 1
    # bob's waterfall has the same shared round, under his own submit.
    assert [r.span.name for r in job_trace(spans, "bob", "job-2").rows] == [
        "submit",
        "trainer round",
        "backbone forward",
    ]
    assert render(job_trace(spans, "acme", "nope")).startswith("no spans of job acme/nope")


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).bodies.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def otlp_receiver() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    bodies: list[tuple[str, bytes]] = []
    handler = type("Receiver", (_Receiver,), {"bodies": bodies})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    server.shutdown()
    server.server_close()


def test_otlp_spans_reach_a_collector_named_by_the_standard_variables(
    otlp_receiver: tuple[str, list[tuple[str, bytes]]],
) -> None:
    url, bodies = otlp_receiver
    assert tracing.exporters_from_environment({}) == []
    assert (
        tracing.exporters_from_environment(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_TRACES_EXPORTER": "none"}
        )
        == []
    )
    exporters = tracing.exporters_from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": url})
    assert len(exporters) == 1
    provider = TracerProvider(resource=Resource.create({"service.name": "joynexus-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporters[0]))
    with provider.get_tracer("t").start_as_current_span(
        "plan", attributes=tracing.job_attributes("acme", "j")
    ):
        pass
    provider.shutdown()
    assert [path for path, _ in bodies] == ["/v1/traces"]
    request = ExportTraceServiceRequest.FromString(bodies[0][1])
    (resource,) = request.resource_spans
    (scope,) = resource.scope_spans
    (span,) = scope.spans
    assert span.name == "plan"
    assert {a.key: a.value.string_value for a in span.attributes} == {
        tracing.TENANT: "acme",
        tracing.JOB: "j",
    }


def _of_job(spans: list[SpanRecord], tenant: str, job_id: str) -> list[SpanRecord]:
    return job_trace(spans, tenant, job_id).spans


def _orphans(spans: list[SpanRecord], trace_ids: set[str]) -> list[SpanRecord]:
    """Spans of these traces whose parent is not in the file (and roots past the first)."""
    mine = [s for s in spans if s.trace_id in trace_ids]
    ids = {(s.trace_id, s.span_id) for s in mine}
    parentless = [s for s in mine if s.parent_span_id and (s.trace_id, s.parent_span_id) not in ids]
    roots = [s for s in mine if not s.parent_span_id]
    return parentless + roots[len(trace_ids) :]


@pytest.mark.timeout(300)
async def test_an_sft_and_an_rl_job_are_each_one_trace_across_the_services(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    path = tmp_path / "trace.jsonl"
    logs = tmp_path / "logs"
    logs.mkdir()
    for role in ("master", "envs", "inferencer", "trainer"):
        args = ["--deterministic"] if role == "trainer" else []
        procs.add(
            start_service(
                role, nats_server.url, logs / f"{role}.log", *args, JOYNEXUS_TRACE_FILE=str(path)
            )
        )
    # This process is the client: its submit spans go to the same file.
    exporter = tracing.JsonLinesSpanExporter(path)
    tracing.setup_tracing("joynexus-client", exporter)
    datasets = record_datasets(tmp_path / "datasets")
    sft_tenant, other_tenant, rl_tenant = uid("trace-sft"), uid("trace-sft2"), uid("trace-rl")
    try:
        spec = sft_spec(sft_tenant, await registered(js, sft_tenant, datasets["reach"]), OFT_2D, 10)
        other = sft_spec(
            other_tenant, await registered(js, other_tenant, datasets["reach"]), OFT_2D, 10
        )
        async with await Client.connect(nats_server.url) as client:
            sft_job, other_job, rl_job = await asyncio.gather(
                client.train_sft(spec),
                client.train_sft(other),
                client.train_rl(rl_spec(rl_tenant, iterations=1)),
            )
            for job in (sft_job, other_job, rl_job):
                assert (await job.wait(180)).status == "succeeded"

        def complete(tenant: str, job_id: str, last: str) -> list[SpanRecord] | None:
            """The job's spans once its last span is written and none lacks its parent."""
            spans = read_spans(path).spans
            drawn = job_trace(spans, tenant, job_id)
            done = any(
                s.name == last
                and (last != "checkpoint commit" or s.attributes.get("joynexus.step") == 10)
                for s in drawn.spans
            )
            return drawn.spans if done and not _orphans(spans, set(drawn.trace_ids)) else None

        sft_spans = await eventually(
            lambda: complete(sft_tenant, sft_job.job_id, "checkpoint commit"),
            timeout=30,
            what="the SFT job's spans, none without its parent",
        )
        other_spans = await eventually(
            lambda: complete(other_tenant, other_job.job_id, "checkpoint commit"),
            timeout=30,
            what="the other SFT job's spans",
        )
        rl_spans = await eventually(
            lambda: complete(rl_tenant, rl_job.job_id, "rl update"),
            timeout=30,
            what="the RL job's spans, none without its parent",
        )
    except BaseException:
        print_log_tails(logs)
        raise
    finally:
        exporter.shutdown()

    # Each job is one connected trace (drawn from one submit; no span without its parent).
    all_spans = read_spans(path).spans
    for tenant, job in ((sft_tenant, sft_job), (other_tenant, other_job), (rl_tenant, rl_job)):
        drawn = job_trace(all_spans, tenant, job.job_id)
        assert len(drawn.trace_ids) == 1, (tenant, drawn.trace_ids)
        assert _orphans(all_spans, set(drawn.trace_ids)) == []
    # A grouped backbone forward served both SFT tenants: it links into both traces.
    both = {sft_spans[0].trace_id, other_spans[0].trace_id}
    assert any(
        both <= {link.trace_id for link in s.links}
        for s in all_spans
        if s.name == "backbone forward"
    ), "no backbone forward linked the requests of both SFT tenants"

    # SFT: one trace from the client's submit to the last commit, through every role.
    mine = [s for s in sft_spans if s.trace_id == sft_spans[0].trace_id]
    root = mine[0]
    assert (root.name, root.kind, root.parent_span_id) == ("submit", "client", "")
    services = {s.service for s in mine}
    assert {"joynexus-master", "joynexus-envs", "joynexus-trainer"} <= services
    names = {s.name for s in mine}
    assert f"answer nexus.ctl.tenant.{sft_tenant}.submit" in names
    assert {"plan", "dataset stream", "train step", "checkpoint commit"} <= names
    steps = sorted(int(s.attributes["joynexus.step"]) for s in mine if s.name == "train step")
    assert steps == list(range(10))
    processes = [s for s in mine if s.name.startswith("process ")]
    assert all(s.attributes["messaging.system"] == "nats" for s in processes)
    assert all("messaging.consumer.group.name" in s.attributes for s in processes)
    # Shared work: every trainer round and backbone forward links to the job's messages.
    rounds = [s for s in sft_spans if s.name == "trainer round"]
    forwards = [s for s in sft_spans if s.name == "backbone forward"]
    assert rounds and forwards and all(s.trace_id != root.trace_id for s in rounds)
    assert all(root.trace_id in {link.trace_id for link in s.links} for s in forwards)

    # RL: episodes, act requests, inferencer batches (linked), the update.
    rl_root = rl_spans[0]
    assert rl_root.name == "submit"
    rl_names = {s.name for s in rl_spans}
    assert {"env task", "episode", "act", "inferencer batch", "rl update"} <= rl_names
    episodes = [s for s in rl_spans if s.name == "episode"]
    assert sorted(int(s.attributes["joynexus.episode"]) for s in episodes) == list(range(8))
    acts = {s.span_id for s in rl_spans if s.name == "act"}
    assert all(s.trace_id == rl_root.trace_id for s in rl_spans if s.name == "act")
    assert acts

    # The command draws it.
    out = await joynexus(
        "trace", rl_tenant, rl_job.job_id, "--trace-file", str(path), "--max-spans", "40"
    )
    print(out.stdout)  # shown with -s, or when an assertion below fails
    assert out.returncode == 0, out.stderr
    assert f"job {rl_tenant}/{rl_job.job_id}:" in out.stdout
    assert "submit [" in out.stdout
    assert "more spans (--max-spans to see them)" in out.stdout
    assert "inferencer batch" in out.stdout and "rl update" in out.stdout
