"""Queue depth and waiting time per tenant, as each scheduling service sees its queue (core
NATS, ``nexus.metrics.queues.<service>``, every couple of seconds): the master's jobs waiting
for their tenant's limits, the trainer's buffered training messages, the inferencer's act
requests waiting for a batch. Services and the operator read them (``joynexus queues``)."""

from __future__ import annotations

from typing import Literal

import msgspec

QueueName = Literal["jobs", "train", "infer"]


class TenantQueue(msgspec.Struct, frozen=True):
    """One tenant's part of a queue: how many items wait and how long the oldest has."""

    tenant: str
    depth: int
    oldest_wait_s: float


class QueueReport(msgspec.Struct, frozen=True, tag="queues"):
    """One service instance's queue, per tenant with anything waiting."""

    service: str
    instance: str
    queue: QueueName
    at: float
    tenants: list[TenantQueue] = msgspec.field(default_factory=list)


QUEUE_REPORT_DECODER = msgspec.msgpack.Decoder(QueueReport)
