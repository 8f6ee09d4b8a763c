"""Heartbeats (``heartbeats`` KV, key ``<role>.<instance>``) and the health report."""

from __future__ import annotations

from typing import Literal

import msgspec

Role = Literal["master", "trainer", "inferencer", "envs", "health", "backbone"]
#: The roles every stack runs (a health report names the missing ones).
ROLES: tuple[str, ...] = ("master", "trainer", "inferencer", "envs", "health")
#: Roles a stack runs only when asked: ``backbone`` with ``joynexus up --backbone-service``.
OPTIONAL_ROLES: tuple[str, ...] = ("backbone",)


class Heartbeat(msgspec.Struct, frozen=True):
    """A role instance says it is alive. Written every ``interval_s``; the bucket's TTL
    expires it when the instance stops writing."""

    role: str
    instance: str
    pid: int
    host: str
    started_at: float
    at: float
    version: str
    #: Messages or tasks currently being worked on.
    in_flight: int = 0
    #: Free-form gauges (queue lags, resident slots, ...).
    gauges: dict[str, float] = msgspec.field(default_factory=dict)


HEARTBEAT_DECODER = msgspec.msgpack.Decoder(Heartbeat)


class RoleHealth(msgspec.Struct, frozen=True):
    """Liveness of one role instance as judged by the health manager."""

    role: str
    instance: str
    alive: bool
    last_seen: float
    age_s: float
    pid: int


class HealthReport(msgspec.Struct, frozen=True):
    """Answer of the health manager on ``nexus.ctl.health``."""

    at: float
    instances: list[RoleHealth]
    healthy_roles: list[str]
    missing_roles: list[str]


HEALTH_REPORT_DECODER = msgspec.msgpack.Decoder(HealthReport)
HEALTH_SUBJECT = "nexus.ctl.health"
