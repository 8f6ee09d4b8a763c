"""The services' OpenTelemetry instruments, read by an in-memory reader. (Prometheus endpoints
of real services: ``tests/test_usage.py``.)"""

from __future__ import annotations

import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from bus.metrics import observe_queue, observe_service
from schemas.metrics import TenantQueue


def _points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, object], float]]]:
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, list[tuple[dict[str, object], float]]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                out[metric.name] = [
                    (dict(p.attributes or {}), float(p.value))  # type: ignore[attr-defined]
                    for p in metric.data.data_points
                ]
    return out


def test_service_and_queue_instruments_read_what_the_heartbeat_and_queue_report_say() -> None:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    gauges = {"busy_s": 3.0, "active_s": 5.0, "samples": 80.0}
    started = time.time() - 10.0
    observe_service("trainer", "trainer-1", started, lambda: gauges, meter)
    waiting = [TenantQueue("acme", 4, 1.5), TenantQueue("bob", 1, 0.2)]
    observe_queue("trainer", "trainer-1", "train", lambda: waiting, meter)
    points = _points(reader)
    who = {"joynexus.role": "trainer", "service.instance.id": "trainer-1"}
    assert points["joynexus.service.busy"] == [(who, 3.0)]
    assert points["joynexus.service.active"] == [(who, 5.0)]
    assert points["joynexus.trainer.samples"] == [(who, 80.0)]
    ((_, held),) = points["joynexus.service.held"]
    ((_, utilization),) = points["joynexus.service.utilization"]
    assert 10.0 <= held < 20.0 and abs(utilization - 3.0 / held) < 0.01
    depth = {p[0]["joynexus.tenant"]: p[1] for p in points["joynexus.queue.depth"]}
    assert depth == {"acme": 4.0, "bob": 1.0}
    waits = {p[0]["joynexus.tenant"]: p[1] for p in points["joynexus.queue.oldest_wait"]}
    assert waits == {"acme": 1.5, "bob": 0.2}
    gauges["busy_s"] = 4.0  # read again at the next collection
    assert _points(reader)["joynexus.service.busy"] == [(who, 4.0)]
