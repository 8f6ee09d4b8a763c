"""Health manager: watches the ``heartbeats`` KV, restarts a dead or stalled role instance in
place, and answers ``nexus.ctl.health``.

What it makes of each instance (:class:`LivenessTable`):

* **alive**: heartbeating, and progressing when it has work in flight;
* **dead**: no heartbeat for ``stale_after_s`` while its key says it runs (a clean stop deletes
  the key): the process is gone, or its event loop is blocked (a frozen process heartbeats no
  more, whatever it holds);
* **stalled**: heartbeating with work in flight and no progress (messages settled) for
  ``stall_after_s``, unless the heartbeat says what long operation holds it up (loading the
  model, building a simulator), which is no stall.

What it does (:class:`Restarts`): an instance dead for ``restart_after_s`` (for
``busy_restart_after_s`` if its last heartbeat said what long operation holds it up: a
simulator built in native code can hold the GIL and with it the heartbeat), or stalled, is
restarted alone, in place: the health manager tells it to exit (a
:class:`~schemas.health.RestartOrder` on ``nexus.ctl.restart.<instance>``; its runtime stops
cleanly and exits 75, and its supervisor — ``joynexus up``'s launcher, a container's restart
policy — starts it anew), and if it runs on this host and is still there after ``grace_s``
(a blocked loop cannot hear the order), kills it. A role is restarted at most
``restart_budget`` times within ``budget_window_s``, with a backoff that doubles from
``backoff_s`` between its restarts; past the budget it is left as it is and an operator event
says so. Every action is an operator event (``nexus.ops.health``) and is in the report, with
the restarts per role.

Every age is measured by the manager's own clock, from when it heard a heartbeat, never from
the time the sender wrote in it: roles on other hosts have other clocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.kv import KeyValue
from opentelemetry.metrics import Observation
from pydantic import Field

from bus import metrics
from bus.auth import any_inbox
from bus.codec import DecodeError, decode, encode
from bus.config import BusConfig
from bus.service import Runtime, serve
from bus.watch import follow_kv
from schemas import subjects
from schemas.health import (
    HEALTH_SUBJECT,
    HEARTBEAT_DECODER,
    OPS_SUBJECT,
    ROLES,
    HealthReport,
    Heartbeat,
    InstanceState,
    OpsEvent,
    OpsKind,
    RestartOrder,
    RoleHealth,
    restart_subject,
)
from schemas.metrics import QUEUE_REPORT_DECODER, QueueReport

log = logging.getLogger(__name__)
#: Operator events kept for the report.
EVENTS_KEPT = 20
#: A queue report older than this is left out of the report (its service stopped).
QUEUES_FRESH_S = 10.0


class HealthConfig(BusConfig):
    """Health manager settings."""

    stale_after_s: float = Field(3.0, gt=0, description="Heartbeat age that counts as dead.")
    restart_after_s: float = Field(
        15.0,
        gt=0,
        description="Restart an instance dead (no heartbeat) this long; longer than "
        "stale_after_s, so a loaded machine's late heartbeat is no reason.",
    )
    busy_restart_after_s: float = Field(
        60.0,
        gt=0,
        description="Restart an instance dead this long when its last heartbeat said a long "
        "operation held it up (a simulator's native build can hold the GIL, and with it the "
        "heartbeat, for many seconds on a loaded machine).",
    )
    stall_after_s: float = Field(
        120.0, gt=0, description="Restart an instance with work in flight and no progress."
    )
    grace_s: float = Field(
        6.0,
        ge=0,
        description="Wait this long after a restart order before killing (this host); longer "
        "than a role's own stop deadline (4.5 s), so a clean stop is not killed midway.",
    )
    restart_budget: int = Field(5, ge=0, description="Restarts of one role per budget window.")
    budget_window_s: float = Field(600.0, gt=0, description="The restart budget's window.")
    backoff_s: float = Field(
        5.0, ge=0, description="Least time between two restarts of a role; doubles each time."
    )
    forget_after_s: float = Field(
        60.0, gt=0, description="Drop an instance dead this long from the report."
    )

    def dead_after_s(self, beat: Heartbeat) -> float:
        """How long an instance whose last heartbeat is ``beat`` may be silent before it is
        restarted."""
        if beat.busy_with:
            return max(self.restart_after_s, self.busy_restart_after_s)
        return self.restart_after_s


@dataclass
class Seen:
    """One instance as the health manager knows it."""

    beat: Heartbeat
    #: When the health manager heard ``beat``, by its own clock: the sender's ``beat.at``
    #: is another host's clock, and a skew of a few seconds would read as death.
    heard_at: float
    #: When its progress counter last moved (the manager's clock, as ``heard_at``).
    progress_at: float
    #: When it was told to restart (0: not).
    ordered_at: float = 0.0


@dataclass
class LivenessTable:
    """Latest heartbeat per instance, and what to make of it."""

    stale_after_s: float
    stall_after_s: float = 120.0
    seen: dict[str, Seen] = field(default_factory=dict)
    alive: dict[str, bool] = field(default_factory=dict)

    @property
    def last(self) -> dict[str, Heartbeat]:
        return {k: s.beat for k, s in self.seen.items()}

    def observe(self, key: str, beat: Heartbeat | None, heard_at: float | None = None) -> None:
        """Take ``beat`` (None: the key was deleted, a clean stop) as heard at ``heard_at``
        by the manager's clock (None: now). An entry the watch replays when it starts counts
        as heard now too: the bucket's TTL bounds its age by the server's clock, and the
        sender's own time is another host's clock. The same beat heard again (a restarted
        watch replays it) is no news and keeps its time."""
        if beat is None:
            self.seen.pop(key, None)
            if self.alive.pop(key, False):
                log.info("%s stopped", key)
            return
        known = self.seen.get(key)
        if known is not None and known.beat == beat:
            return
        if heard_at is None:
            heard_at = time.time()
        # A stall is time with work in hand and no progress: idle time (nothing in flight)
        # or time busy with a long operation does not count, so the clock starts again
        # when work comes in or the operation ends.
        was_due = known is not None and known.beat.in_flight > 0 and not known.beat.busy_with
        if known is None or known.beat.progress != beat.progress or not was_due:
            progress_at = heard_at
        else:
            progress_at = known.progress_at
        ordered = known.ordered_at if known is not None else 0.0
        self.seen[key] = Seen(beat, heard_at, progress_at, ordered)

    def state(self, key: str, now: float) -> InstanceState:
        s = self.seen[key]
        if s.ordered_at:
            return "restarting"
        if now - s.heard_at > self.stale_after_s:
            return "dead"
        stalled_s = s.heard_at - s.progress_at
        if s.beat.in_flight > 0 and not s.beat.busy_with and stalled_s > self.stall_after_s:
            return "stalled"
        return "alive"

    def sweep(self, now: float) -> list[tuple[str, bool]]:
        """Update alive flags; return the transitions (key, now_alive)."""
        changes = []
        for key in self.seen:
            alive = self.state(key, now) == "alive"
            if self.alive.get(key) != alive:
                self.alive[key] = alive
                changes.append((key, alive))
        return changes

    def report(self, now: float, restarts: dict[str, int], events: list[OpsEvent]) -> HealthReport:
        instances = []
        for key, s in self.seen.items():
            b = s.beat
            state = self.state(key, now)
            instances.append(
                RoleHealth(
                    b.role,
                    b.instance,
                    state == "alive",
                    s.heard_at,
                    now - s.heard_at,
                    b.pid,
                    state,
                    b.host,
                    b.at - b.started_at,
                    b.progress,
                    now - s.progress_at,
                    b.in_flight,
                    b.busy_with,
                )
            )
        healthy = sorted({h.role for h in instances if h.alive})
        return HealthReport(
            now,
            instances,
            healthy,
            [r for r in ROLES if r not in healthy],
            dict(restarts),
            list(events),
        )


@dataclass
class Restarts:
    """The restart budget and backoff, per role (a pure policy: tested without a bus)."""

    budget: int
    window_s: float
    backoff_s: float
    done: dict[str, deque[float]] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)

    def decide(self, role: str, now: float) -> str:
        """``restart``, ``wait`` (its backoff is not over) or ``exhausted``."""
        recent = self.done.setdefault(role, deque())
        while recent and now - recent[0] > self.window_s:
            recent.popleft()
        if len(recent) >= self.budget:
            return "exhausted"
        if recent and now - recent[-1] < self.backoff_s * 2 ** (len(recent) - 1):
            return "wait"
        return "restart"

    def record(self, role: str, now: float) -> None:
        self.done.setdefault(role, deque()).append(now)
        self.total[role] = self.total.get(role, 0) + 1


def same_host(host: str) -> bool:
    return host == socket.gethostname()


def runs_role(pid: int, role: str) -> bool:
    """Whether ``pid`` on this host is still a ``services.<role>`` process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ")
    except OSError:
        return False
    return f"services.{role}".encode() in cmdline


class OwnView:
    """Whether the health manager's own view of the heartbeats is current: not while its
    connection is down, nor for ``settle_s`` after it reconnected (the heartbeats written
    meanwhile are still coming in; every instance would look dead), nor while its own
    heartbeat, written every second through the same bucket and seen through the same
    watch, is older than ``stale_s`` (the bucket or the watch stopped with the connection
    up: a stream leader election, API timeouts on a loaded node)."""

    def __init__(self, settle_s: float, stale_s: float) -> None:
        self.settle_s = settle_s
        self.stale_s = stale_s
        self.reconnects = 0
        self.blind_until = 0.0

    def acting(
        self, connected: bool, reconnects: int, now: float, own_beat_at: float | None
    ) -> bool:
        """``own_beat_at``: when its own latest heartbeat was heard (None: none yet)."""
        if not connected or reconnects != self.reconnects:
            self.reconnects = reconnects
            self.blind_until = now + self.settle_s
        current = own_beat_at is not None and now - own_beat_at <= self.stale_s
        return now >= self.blind_until and current


class HealthManager:
    """The table, the policy, and what it does about dead and stalled instances."""

    def __init__(self, rt: Runtime, config: HealthConfig) -> None:
        self.rt = rt
        self.config = config
        self.table = LivenessTable(config.stale_after_s, config.stall_after_s)
        self.restarts = Restarts(config.restart_budget, config.budget_window_s, config.backoff_s)
        metrics.meter().create_observable_counter(
            "joynexus.restarts",
            [
                lambda _: [
                    Observation(n, {"joynexus.role": role})
                    for role, n in self.restarts.total.items()
                ]
            ],
            unit="{restart}",
            description="Restarts the health manager ordered, per role.",
        )
        self.events: deque[OpsEvent] = deque(maxlen=EVENTS_KEPT)
        #: Roles whose exhausted budget was reported (once until it recovers).
        self.exhausted: set[str] = set()
        #: The latest queue report of each service instance (``joynexus status`` shows them).
        self.queues: dict[str, QueueReport] = {}
        #: Heartbeats it could not see while its own connection was down are no sign of
        #: anyone's death: it acts only on a view it has had time to renew.
        self.view = OwnView(config.restart_after_s, config.stale_after_s)

    def report(self) -> HealthReport:
        report = self.table.report(time.time(), self.restarts.total, list(self.events))
        fresh = [q for q in self.queues.values() if time.time() - q.at < QUEUES_FRESH_S]
        return msgspec.structs.replace(report, queues=fresh)

    async def on_queues(self, msg: Msg) -> None:
        with contextlib.suppress(DecodeError):
            report = decode(QUEUE_REPORT_DECODER, msg.data)
            self.queues[f"{report.service}.{report.instance}"] = report
            # Instances come and go (a restart is a new one): keep only the current reports.
            stale = [k for k, q in self.queues.items() if report.at - q.at > QUEUES_FRESH_S]
            for key in stale:
                del self.queues[key]

    async def answer(self, msg: Msg) -> None:
        if any_inbox(msg.reply):  # never onto a stream's or a service's subject
            await msg.respond(encode(self.report()))

    def observe(self, entry: KeyValue.Entry) -> None:
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self.table.observe(entry.key, None)
            return
        try:
            self.table.observe(entry.key, decode(HEARTBEAT_DECODER, entry.value), time.time())
        except DecodeError as exc:
            log.warning("ignoring malformed heartbeat %s: %s", entry.key, exc)

    async def tick(self, now: float) -> None:
        """One look at every instance: log transitions, act on the dead and the stalled
        (not within ``restart_after_s`` of its own reconnect: it has to see every instance's
        heartbeats afresh first)."""
        nc = self.rt.nc
        own = [
            s.heard_at
            for s in self.table.seen.values()
            if s.beat.role == "health" and s.beat.instance == self.rt.instance
        ]
        reconnects = int(nc.stats["reconnects"])
        acting = self.view.acting(nc.is_connected, reconnects, now, max(own, default=None))
        for key, alive in self.table.sweep(now):
            log.info("%s is %s", key, "alive" if alive else self.table.state(key, now))
        for key, seen in list(self.table.seen.items()):
            beat = seen.beat
            if beat.role == "health" and beat.instance == self.rt.instance:
                continue
            state = self.table.state(key, now)
            if state == "restarting":
                await self.follow_up(key, seen, now)
            elif state == "dead":
                silent_s = now - seen.heard_at
                if same_host(beat.host) and not runs_role(beat.pid, beat.role):
                    # The process is gone: its supervisor starts a new one (a new instance).
                    if silent_s > self.config.forget_after_s:
                        self.table.observe(key, None)
                elif silent_s > self.config.dead_after_s(beat) and acting:
                    await self.restart(key, seen, f"no heartbeat for {silent_s:.0f} s", now)
            elif state == "stalled":
                if acting:
                    stalled_s = seen.heard_at - seen.progress_at
                    reason = f"{beat.in_flight} in flight and no progress for {stalled_s:.0f} s"
                    await self.restart(key, seen, reason, now)
            elif self.restarts.decide(beat.role, now) != "exhausted":
                self.exhausted.discard(beat.role)  # its budget is back: say it again if spent

    async def restart(self, key: str, seen: Seen, reason: str, now: float) -> None:
        beat = seen.beat
        decision = self.restarts.decide(beat.role, now)
        if decision == "wait":
            return
        if decision == "exhausted":
            if beat.role not in self.exhausted:
                self.exhausted.add(beat.role)
                await self.emit("budget_exhausted", beat, f"{reason}; restart budget spent")
            return
        self.restarts.record(beat.role, now)
        seen.ordered_at = now
        log.warning("restarting %s: %s", beat.instance, reason)
        with contextlib.suppress(NatsError):
            await self.rt.nc.publish(
                restart_subject(beat.instance), encode(RestartOrder(beat.instance, reason))
            )
        await self.emit("restart", beat, reason)

    async def follow_up(self, key: str, seen: Seen, now: float) -> None:
        """An instance told to restart: killed if it is still there past the grace (on
        this host); forgotten once gone."""
        beat = seen.beat
        local = same_host(beat.host)
        if local and not runs_role(beat.pid, beat.role):
            self.table.observe(key, None)  # it exited; its supervisor starts it again
            return
        if local and now - seen.ordered_at > self.config.grace_s:
            log.warning("%s (pid %d) did not exit: killing it", beat.instance, beat.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(beat.pid, signal.SIGKILL)
        elif not local and now - seen.ordered_at > self.config.forget_after_s:
            self.table.observe(key, None)  # another host's: its container is restarted

    async def emit(self, kind: OpsKind, beat: Heartbeat, reason: str) -> None:
        event = OpsEvent(kind, beat.role, beat.instance, beat.pid, reason, time.time())
        self.events.append(event)
        with contextlib.suppress(NatsError):
            await self.rt.nc.publish(OPS_SUBJECT, encode(event))


async def run(config: HealthConfig) -> None:
    """Entry point: serve the health manager until SIGTERM/SIGINT."""

    async def body(rt: Runtime) -> None:
        manager = HealthManager(rt, config)
        kv = await rt.js.key_value(subjects.KV_HEARTBEATS)
        sub = await rt.nc.subscribe(HEALTH_SUBJECT, cb=manager.answer)
        queues = await rt.nc.subscribe(f"{subjects.QUEUE_METRICS}.>", cb=manager.on_queues)
        rt.spawn(follow_kv(kv, rt.stop, manager.observe), "heartbeats follower")
        try:
            while not rt.stop.is_set():
                await manager.tick(time.time())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(rt.stop.wait(), 0.5)
        finally:
            for subscription in (sub, queues):
                with contextlib.suppress(NatsError, TimeoutError):
                    await asyncio.wait_for(subscription.unsubscribe(), 0.5)

    await serve("health", config, body)
