"""Health manager: watches the ``heartbeats`` KV and answers ``nexus.ctl.health``.

An instance is alive while its last heartbeat is younger than ``stale_after_s``; a clean stop
deletes its key. Transitions are logged. The local launcher restarts crashed child processes;
a role that is alive as a process but silent shows up here as missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.kv import KeyValue
from pydantic import Field

from bus.auth import any_inbox
from bus.codec import DecodeError, decode, encode
from bus.config import BusConfig
from bus.service import Runtime, serve
from bus.watch import follow_kv
from schemas import subjects
from schemas.health import (
    HEALTH_SUBJECT,
    HEARTBEAT_DECODER,
    ROLES,
    HealthReport,
    Heartbeat,
    RoleHealth,
)

log = logging.getLogger(__name__)


class HealthConfig(BusConfig):
    """Health manager settings."""

    stale_after_s: float = Field(3.0, gt=0, description="Heartbeat age that counts as dead.")


@dataclass
class LivenessTable:
    """Latest heartbeat per instance, judged against ``stale_after_s``."""

    stale_after_s: float
    last: dict[str, Heartbeat] = field(default_factory=dict)
    alive: dict[str, bool] = field(default_factory=dict)

    def observe(self, key: str, beat: Heartbeat | None) -> None:
        if beat is None:
            self.last.pop(key, None)
            if self.alive.pop(key, False):
                log.info("%s stopped", key)
            return
        self.last[key] = beat

    def sweep(self, now: float) -> list[tuple[str, bool]]:
        """Update alive flags; return the transitions (key, now_alive)."""
        changes = []
        for key, beat in self.last.items():
            alive = now - beat.at <= self.stale_after_s
            if self.alive.get(key) != alive:
                self.alive[key] = alive
                changes.append((key, alive))
        return changes

    def report(self, now: float) -> HealthReport:
        instances = [
            RoleHealth(
                b.role, b.instance, now - b.at <= self.stale_after_s, b.at, now - b.at, b.pid
            )
            for b in self.last.values()
        ]
        healthy = sorted({h.role for h in instances if h.alive})
        return HealthReport(now, instances, healthy, [r for r in ROLES if r not in healthy])


async def run(config: HealthConfig) -> None:
    """Entry point: serve the health manager until SIGTERM/SIGINT."""

    async def body(rt: Runtime) -> None:
        table = LivenessTable(config.stale_after_s)
        kv = await rt.js.key_value(subjects.KV_HEARTBEATS)

        async def answer(msg: Msg) -> None:
            if any_inbox(msg.reply):  # never onto a stream's or a service's subject
                await msg.respond(encode(table.report(time.time())))

        def observe(entry: KeyValue.Entry) -> None:
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                table.observe(entry.key, None)
                return
            try:
                table.observe(entry.key, decode(HEARTBEAT_DECODER, entry.value))
            except DecodeError as exc:
                log.warning("ignoring malformed heartbeat %s: %s", entry.key, exc)

        sub = await rt.nc.subscribe(HEALTH_SUBJECT, cb=answer)
        rt.spawn(follow_kv(kv, rt.stop, observe), "heartbeats follower")
        try:
            while not rt.stop.is_set():
                for key, alive in table.sweep(time.time()):
                    log.info("%s is %s", key, "alive" if alive else "NOT responding")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(rt.stop.wait(), 0.5)
        finally:
            with contextlib.suppress(NatsError, TimeoutError):
                await asyncio.wait_for(sub.unsubscribe(), 0.5)

    await serve("health", config, body)
