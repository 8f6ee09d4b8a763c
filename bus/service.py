"""The service runtime every role runs in: connect, declare, heartbeat, clean stop.

``await serve(role, config, body)`` connects to the bus, declares the layout, heartbeats into
the ``heartbeats`` KV every ``heartbeat_interval_s`` and runs ``body(runtime)`` until it
returns or SIGTERM/SIGINT sets ``runtime.stop``; the body is expected to stop pulling, finish
or release in-flight work and return. The heartbeat key is deleted on a clean stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from bus.codec import encode
from bus.config import BusConfig
from bus.connect import connect
from bus.declare import BusLayout, declare
from bus.tracing import setup_tracing
from schemas import subjects
from schemas.health import Heartbeat

log = logging.getLogger(__name__)
VERSION = "0.1.0"


@dataclass
class Runtime:
    """What a running service holds: its connection, JetStream context and stop event."""

    role: str
    config: BusConfig
    nc: NATS
    js: JetStreamContext
    instance: str
    started_at: float
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    #: Callables reporting in-flight work and gauges for the heartbeat.
    in_flight: Callable[[], int] = lambda: 0
    gauges: Callable[[], dict[str, float]] = dict
    heartbeats_kv: KeyValue | None = None

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            role=self.role,
            instance=self.instance,
            pid=os.getpid(),
            host=socket.gethostname(),
            started_at=self.started_at,
            at=time.time(),
            version=VERSION,
            in_flight=self.in_flight(),
            gauges=self.gauges(),
        )

    @property
    def heartbeat_key(self) -> str:
        return f"{self.role}.{self.instance}"


def default_instance(role: str) -> str:
    host = "".join(c if c.isalnum() or c == "-" else "-" for c in socket.gethostname().lower())
    return f"{role}-{host[:24]}-{os.getpid()}"


async def _heartbeat_loop(rt: Runtime) -> None:
    assert rt.heartbeats_kv is not None
    while not rt.stop.is_set():
        try:
            await rt.heartbeats_kv.put(rt.heartbeat_key, encode(rt.heartbeat()))
        except (NatsError, OSError) as exc:
            # A broker restart must not kill the service; the next tick retries.
            log.warning("heartbeat failed: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(rt.stop.wait(), rt.config.heartbeat_interval_s)


#: Longest a stopping service waits for its subscriptions to drain. nats.py's own default is
#: 30 s, and a push subscription (a KV watcher's) that keeps receiving can use all of it.
DRAIN_TIMEOUT_S = 3.0


async def close_connection(nc: NATS) -> None:
    """Drain (flush what we published, finish pending callbacks), bounded; then close."""
    try:
        await asyncio.wait_for(nc.drain(), DRAIN_TIMEOUT_S)
    except (TimeoutError, NatsError) as exc:
        log.warning("drain did not finish (%s); closing", exc or "timeout")
    if not nc.is_closed:
        await nc.close()


def setup_logging(config: BusConfig, role: str) -> None:
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
    )


async def serve(
    role: str, config: BusConfig, body: Callable[[Runtime], Coroutine[Any, Any, None]]
) -> None:
    """Run ``body`` as role ``role`` until it returns or a stop signal arrives."""
    setup_logging(config, role)
    setup_tracing(f"joynexus-{role}")
    tls = ssl.create_default_context(cafile=config.tls_ca) if config.tls_ca else None
    nc = await connect(
        config.url,
        name=f"joynexus-{role}",
        creds=config.creds,
        user=config.user,
        password=config.password,
        tls=tls,
    )
    js = nc.jetstream()
    rt = Runtime(role, config, nc, js, config.instance or default_instance(role), time.time())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.stop.set)
    heartbeat_task: asyncio.Task[None] | None = None
    try:
        await declare(js, BusLayout(replicas=config.replicas))
        rt.heartbeats_kv = await js.key_value(subjects.KV_HEARTBEATS)
        heartbeat_task = asyncio.create_task(_heartbeat_loop(rt))
        log.info("%s %s started (pid %d) on %s", role, rt.instance, os.getpid(), config.url)
        body_task = asyncio.create_task(body(rt))
        stop_task = asyncio.create_task(rt.stop.wait())
        done, _ = await asyncio.wait({body_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if body_task in done:
            rt.stop.set()
            body_task.result()  # re-raise a crash so the process exits non-zero
        else:
            # The body sees rt.stop and winds down (release in-flight work) on its own.
            await body_task
        stop_task.cancel()
        log.info("%s %s stopping", role, rt.instance)
    finally:
        rt.stop.set()
        if heartbeat_task is not None:
            await heartbeat_task
        if rt.heartbeats_kv is not None:
            with contextlib.suppress(Exception):
                await rt.heartbeats_kv.delete(rt.heartbeat_key)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await close_connection(nc)


@contextlib.asynccontextmanager
async def placed(rt: Runtime, backbone_id: str) -> AsyncIterator[None]:
    """Announce in the ``placement`` KV that this instance serves ``backbone_id`` for as long
    as the block runs (key ``<role>.<backbone>.<instance>``)."""
    placement = await rt.js.key_value(subjects.KV_PLACEMENT)
    key = f"{rt.role}.{backbone_id}.{rt.instance}"
    await placement.put(key, msgspec.json.encode({"backbone": backbone_id, "role": rt.role}))
    try:
        yield
    finally:
        with contextlib.suppress(NatsError):
            await placement.delete(key)
