"""Metrics through the OpenTelemetry metrics API: a Prometheus endpoint and OTLP.

Every role exports what it already measures for its heartbeat (:mod:`bus.metering`):
``joynexus.service.busy`` (seconds computing), ``.active`` (seconds with work in hand),
``.held`` (seconds running) and ``.utilization`` (busy / held); the scheduling services their
queue per tenant (``joynexus.queue.depth``, ``joynexus.queue.oldest_wait``); the trainer the
samples it trained; the inferencer each act request's latency (a histogram, from the request's
``sent_at`` to its answer); the health manager the restarts it ordered per role.

Readers (:func:`setup_metrics`): a Prometheus endpoint with ``--metrics-port``
(``opentelemetry-exporter-prometheus``), and OTLP when ``opentelemetry-exporter-otlp-proto-http``
is installed and an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``; ``OTEL_METRICS_EXPORTER=none`` turns it off). With
neither, the API's no-op meter records nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from schemas.metrics import TenantQueue

log = logging.getLogger(__name__)

METER_NAME = "joynexus"


def meter() -> metrics.Meter:
    return metrics.get_meter(METER_NAME)


def _readers(port: int, host: str, environ: Mapping[str, str]) -> list[MetricReader]:
    readers: list[MetricReader] = []
    if port:
        try:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import start_http_server
        except ImportError:
            log.error(
                "--metrics-port %d: opentelemetry-exporter-prometheus is not installed, so no "
                "Prometheus endpoint is served",
                port,
            )
        else:
            try:
                start_http_server(port, addr=host)
            except OSError as exc:  # the port is taken: the service runs on, unexported
                log.error("metrics: cannot serve on %s:%d: %s", host, port, exc)
            else:
                readers.append(PrometheusMetricReader())
                log.info("metrics: Prometheus endpoint on http://%s:%d/metrics", host, port)
    signal_endpoint = environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    base_endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    wanted = environ.get("OTEL_METRICS_EXPORTER", "otlp").lower()
    if (signal_endpoint or base_endpoint) and "none" not in wanted:
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )
        except ImportError:
            log.warning(
                "an OTLP endpoint is set but opentelemetry-exporter-otlp-proto-http is not "
                "installed: no metrics are sent there"
            )
        else:
            endpoint = signal_endpoint or base_endpoint.rstrip("/") + "/v1/metrics"
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint)))
    return readers


def setup_metrics(
    service_name: str, port: int = 0, host: str = "127.0.0.1", environ: Mapping[str, str] = {}
) -> MeterProvider | None:
    """Install a meter provider with the readers asked for (None, and the no-op API, when
    none is)."""
    readers = _readers(port, host, environ)
    if not readers:
        return None
    provider = MeterProvider(
        metric_readers=readers,
        resource=Resource.create({"service.name": service_name}),
        shutdown_on_exit=False,
    )
    metrics.set_meter_provider(provider)
    return provider


def observe_service(
    role: str,
    instance: str,
    started_at: float,
    gauges: Callable[[], dict[str, float]],
    m: metrics.Meter | None = None,
) -> None:
    """The service's busy, active and held seconds and utilization, read from ``gauges()``
    (its heartbeat's) whenever a reader collects."""
    attributes = {"joynexus.role": role, "service.instance.id": instance}

    def reading(name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            value = gauges().get(name)
            return [] if value is None else [Observation(value, attributes)]

        return observe

    def held(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(time.time() - started_at, attributes)]

    def utilization(_: CallbackOptions) -> Iterable[Observation]:
        busy = gauges().get("busy_s")
        held_s = time.time() - started_at
        return [] if busy is None or held_s <= 0 else [Observation(busy / held_s, attributes)]

    m = m or meter()
    m.create_observable_counter(
        "joynexus.service.busy", [reading("busy_s")], unit="s", description="Seconds computing."
    )
    m.create_observable_counter(
        "joynexus.service.active",
        [reading("active_s")],
        unit="s",
        description="Seconds with work in hand.",
    )
    m.create_observable_counter(
        "joynexus.service.held", [held], unit="s", description="Seconds the instance has run."
    )
    m.create_observable_gauge(
        "joynexus.service.utilization",
        [utilization],
        unit="1",
        description="Busy seconds over held seconds since the instance started.",
    )
    if role == "trainer":
        m.create_observable_counter(
            "joynexus.trainer.samples",
            [reading("samples")],
            unit="{sample}",
            description="Samples trained (SFT rows, RL steps learned from).",
        )


def observe_queue(
    service: str,
    instance: str,
    queue: str,
    snapshot: Callable[[], list[TenantQueue]],
    m: metrics.Meter | None = None,
) -> None:
    """A scheduling service's queue per tenant: depth and the oldest item's wait."""

    def observe(field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def read(_: CallbackOptions) -> Iterable[Observation]:
            return [
                Observation(
                    getattr(t, field),
                    {
                        "joynexus.role": service,
                        "service.instance.id": instance,
                        "joynexus.queue": queue,
                        "joynexus.tenant": t.tenant,
                    },
                )
                for t in snapshot()
            ]

        return read

    m = m or meter()
    m.create_observable_gauge(
        "joynexus.queue.depth", [observe("depth")], unit="{item}", description="Items waiting."
    )
    m.create_observable_gauge(
        "joynexus.queue.oldest_wait",
        [observe("oldest_wait_s")],
        unit="s",
        description="How long the oldest waiting item has waited.",
    )
