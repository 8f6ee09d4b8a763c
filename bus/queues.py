"""Publishing a service's queue per tenant (:mod:`schemas.metrics`) while it runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from bus.codec import encode
from bus.metrics import observe_queue
from schemas import subjects
from schemas.metrics import QueueName, QueueReport, TenantQueue

log = logging.getLogger(__name__)
#: How often a service publishes its queue.
REPORT_EVERY_S = 2.0


def per_tenant(waiting: Iterable[tuple[str, float]], now: float) -> list[TenantQueue]:
    """``(tenant, since)`` of each waiting item → each tenant's depth and oldest wait."""
    depth: dict[str, int] = defaultdict(int)
    oldest: dict[str, float] = {}
    for tenant, since in waiting:
        depth[tenant] += 1
        oldest[tenant] = min(oldest.get(tenant, since), since)
    return [TenantQueue(t, depth[t], max(0.0, now - oldest[t])) for t in sorted(depth)]


async def publish_queues(
    nc: NATS,
    stop: asyncio.Event,
    service: str,
    instance: str,
    queue: QueueName,
    snapshot: Callable[[], list[TenantQueue]],
    every_s: float = REPORT_EVERY_S,
) -> None:
    """Until ``stop``: publish ``snapshot()`` on ``nexus.metrics.queues.<service>`` every
    ``every_s`` (core NATS: a report the broker cannot take now is skipped)."""
    subject = f"{subjects.QUEUE_METRICS}.{service}"
    observe_queue(service, instance, queue, snapshot)
    while not stop.is_set():
        report = QueueReport(service, instance, queue, time.time(), snapshot())
        try:
            await nc.publish(subject, encode(report))
        except NatsError as exc:
            log.debug("queue report not published: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
