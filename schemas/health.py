"""Heartbeats (``heartbeats`` KV, key ``<role>.<instance>``) and the health report."""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.metrics import QueueReport

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
    #: Work finished so far (messages settled): an instance with work in flight whose
    #: progress stands still is stalled.
    progress: int = 0
    #: A long operation under way that makes no progress meanwhile and is no stall
    #: (loading the model, building a simulator), or "".
    busy_with: str = ""


HEARTBEAT_DECODER = msgspec.msgpack.Decoder(Heartbeat)


#: What the health manager makes of an instance: heartbeating and progressing (``alive``),
#: heartbeating with work in flight and no progress past the deadline (``stalled``), no
#: heartbeat for too long while its key says it runs (``dead``), or told to restart and not
#: gone yet (``restarting``).
InstanceState = Literal["alive", "stalled", "dead", "restarting"]


class RoleHealth(msgspec.Struct, frozen=True):
    """Liveness of one role instance as judged by the health manager."""

    role: str
    instance: str
    alive: bool
    last_seen: float
    age_s: float
    pid: int
    state: InstanceState = "alive"
    host: str = ""
    uptime_s: float = 0.0
    progress: int = 0
    #: Seconds since its progress last moved.
    progress_age_s: float = 0.0
    in_flight: int = 0
    busy_with: str = ""


OpsKind = Literal["restart", "budget_exhausted"]


class OpsEvent(msgspec.Struct, frozen=True, tag="ops"):
    """What the health manager did or could not do (core NATS ``nexus.ops.health``, and the
    last ones in its report): ``restart`` (it told an instance to exit, and killed it if it
    did not), or ``budget_exhausted`` (a role that failed again too often is left as it is)."""

    kind: OpsKind
    role: str
    instance: str
    pid: int
    reason: str
    at: float


class RestartOrder(msgspec.Struct, frozen=True, tag="restart"):
    """The health manager asks one instance (``nexus.ctl.restart.<instance>``) to exit so
    that its supervisor (the local launcher, a container's restart policy) starts it anew."""

    instance: str
    reason: str


class HealthReport(msgspec.Struct, frozen=True):
    """Answer of the health manager on ``nexus.ctl.health``."""

    at: float
    instances: list[RoleHealth]
    healthy_roles: list[str]
    missing_roles: list[str]
    #: Restarts the health manager ordered, per role.
    restarts: dict[str, int] = msgspec.field(default_factory=dict)
    #: Its latest operator events, oldest first.
    events: list[OpsEvent] = msgspec.field(default_factory=list)
    #: The latest queue report of each scheduling service instance (:mod:`schemas.metrics`).
    queues: list[QueueReport] = msgspec.field(default_factory=list)


HEALTH_REPORT_DECODER = msgspec.msgpack.Decoder(HealthReport)
OPS_EVENT_DECODER = msgspec.msgpack.Decoder(OpsEvent)
RESTART_ORDER_DECODER = msgspec.msgpack.Decoder(RestartOrder)
HEALTH_SUBJECT = "nexus.ctl.health"
#: The health manager's operator events.
OPS_SUBJECT = "nexus.ops.health"


def restart_subject(instance: str) -> str:
    """Where one instance listens for its :class:`RestartOrder`."""
    return f"nexus.ctl.restart.{instance}"
