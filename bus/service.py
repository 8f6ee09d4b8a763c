"""The service runtime every role runs in: connect, declare, heartbeat, one stop protocol.

``await serve(role, config, body)`` installs the SIGTERM/SIGINT handlers first (before
anything slow), connects to the bus, declares the layout, heartbeats into the ``heartbeats``
KV and runs ``body(runtime)``. Stop protocol (Temporal's worker shape):

* a signal sets ``runtime.stop``; every loop (the body's, the heartbeat, the consumer's
  keep-alive, KV followers) checks it and returns — nothing is stopped by ``task.cancel()``,
  whose cancel Python 3.11 can lose inside nats.py's ``wait_for`` calls (PITFALLS);
* background work runs in one ``TaskGroup`` (:meth:`Runtime.spawn`); a crash in any of it
  sets ``stop`` so the rest winds down, and is re-raised once everything has returned (exit
  non-zero);
* slow blocking work (loading the model) runs in a daemon thread via :meth:`Runtime.slow`,
  which gives up waiting as soon as ``stop`` is set;
* on the way out the consumer hands back whatever it fetched and did not settle, the
  heartbeat key is deleted, and the connection is drained with a bound;
* a last-resort watchdog ends the process (exit 3, logged) if a stop takes longer than
  :data:`STOP_DEADLINE_S`, so a hang is visible and never outlives the deadline;
* a role's own process (:func:`main`) also exits 75, for its supervisor to restart it, when
  its event loop has not run for ``--loop-stall-s``: a hung role is restarted where the
  health manager cannot kill it (another host, a container).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from bus import liveness, stopping
from bus.codec import DecodeError, decode, encode
from bus.config import BusConfig
from bus.connect import connect
from bus.consume import Consumer
from bus.declare import BusLayout, declare
from bus.metrics import observe_service, setup_metrics
from bus.tracing import flush_tracing, setup_tracing
from schemas import subjects
from schemas.health import RESTART_ORDER_DECODER, Heartbeat, restart_subject

log = logging.getLogger(__name__)
VERSION = "0.1.0"


P = ParamSpec("P")
T = TypeVar("T")

#: A stop that has not finished after this long ends the process (exit 3).
STOP_DEADLINE_S = 4.5
#: Exit status of a stop the watchdog had to end.
EXIT_STOP_DEADLINE = 3
#: Exit status of a stop the health manager asked for (a restart): not 0, so a supervisor
#: that restarts only failures (a container's ``on-failure``) starts the role again.
EXIT_RESTART = 75
#: Set when a :class:`~schemas.health.RestartOrder` stopped this process.
_restart_ordered = False


class ServiceStopping(Exception):
    """Raised by :meth:`Runtime.slow` when the service is told to stop while it waits; a body
    that lets it escape ends cleanly."""


@dataclass
class Runtime:
    """What a running service holds: its connection, JetStream context, stop event and the
    consume runtime every handler's message goes through."""

    role: str
    config: BusConfig
    nc: NATS
    js: JetStreamContext
    instance: str
    started_at: float
    stop: asyncio.Event
    consumer: Consumer
    #: Callables reporting in-flight work and gauges for the heartbeat.
    in_flight: Callable[[], int] = lambda: 0
    gauges: Callable[[], dict[str, float]] = dict
    #: The role's own progress counter, added to the messages its consumer settled.
    progress: Callable[[], int] = lambda: 0
    #: The long operation the role is in ("" if none): no progress meanwhile is no stall.
    busy_with: Callable[[], str] = lambda: ""
    #: What :meth:`slow` runs (the heartbeat says so too).
    slow_label: str = ""
    heartbeats_kv: KeyValue | None = None
    _tasks: asyncio.TaskGroup | None = None
    crash: BaseException | None = None

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
            progress=self.consumer.settled + self.progress(),
            busy_with=self.slow_label or self.busy_with(),
        )

    async def beat_now(self) -> None:
        """Publish a heartbeat now (bounded; a failure is left to the next tick): before work
        that may hold the GIL, and with it the heartbeat loop, for long (a simulator's native
        build), so the last heartbeat the health manager sees says what the role is doing."""
        if self.heartbeats_kv is None:
            return
        try:
            await asyncio.wait_for(
                self.heartbeats_kv.put(self.heartbeat_key, encode(self.heartbeat())), 2.0
            )
        except (NatsError, OSError, TimeoutError) as exc:
            log.info("heartbeat not published now: %s", exc)

    @property
    def heartbeat_key(self) -> str:
        return f"{self.role}.{self.instance}"

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` in the service's task group. It must return once ``stop`` is set; if
        it raises, the service stops and exits non-zero."""
        assert self._tasks is not None, "spawn() is for the body, inside serve()"
        self._tasks.create_task(self._guard(work, name), name=name)

    async def _guard(self, work: Coroutine[Any, Any, None], name: str) -> None:
        try:
            await work
        except ServiceStopping:
            pass
        except Exception as exc:  # recorded, stops the service, re-raised by serve()
            log.error("%s crashed", name, exc_info=exc)
            if self.crash is None:
                self.crash = exc
        finally:
            self.stop.set()  # the body ended or something crashed: the service stops

    async def slow(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` in a daemon thread; raises :class:`ServiceStopping` if the
        service is told to stop first (the thread is left to finish on its own and cannot keep
        the process alive)."""
        done = in_daemon_thread(lambda: fn(*args, **kwargs), f"{self.role}-slow")
        self.slow_label = getattr(fn, "__name__", "slow start-up work")
        try:
            while not done.done():
                if self.stop.is_set():
                    raise ServiceStopping(f"{self.role} stopping")
                await asyncio.wait({done}, timeout=0.1)
        finally:
            self.slow_label = ""
        return done.result()


def in_daemon_thread(fn: Callable[[], T], name: str) -> asyncio.Future[T]:
    """``fn()`` in a daemon thread, as a future of the running loop. Unlike the default
    executor (which ``asyncio.run`` joins at exit), work abandoned at a stop cannot hold the
    process up."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def deliver(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(deliver, result, error)

    threading.Thread(target=work, name=name, daemon=True).start()
    return done


def default_instance(role: str) -> str:
    host = "".join(c if c.isalnum() or c == "-" else "-" for c in socket.gethostname().lower())
    return f"{role}-{host[:24]}-{os.getpid()}"


async def _heartbeat_loop(rt: Runtime) -> None:
    assert rt.heartbeats_kv is not None
    while not rt.stop.is_set():
        try:
            await rt.heartbeats_kv.put(rt.heartbeat_key, encode(rt.heartbeat()))
        except (NatsError, OSError, TimeoutError) as exc:
            # A broker restart must not kill the service; the next tick retries.
            log.warning("heartbeat failed: %s", exc)
        else:
            if rt.config.health_file:
                liveness.mark_alive(rt.config.health_file)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(rt.stop.wait(), rt.config.heartbeat_interval_s)


#: Longest a stopping service waits for its subscriptions to drain. nats.py's own default is
#: 30 s, and a push subscription (a KV watcher's) that keeps receiving can use all of it.
DRAIN_TIMEOUT_S = 1.5


async def close_connection(nc: NATS) -> None:
    """Drain (flush what we published, finish pending callbacks), bounded; then close."""
    try:
        await asyncio.wait_for(nc.drain(), DRAIN_TIMEOUT_S)
    except (TimeoutError, NatsError) as exc:
        log.warning("drain did not finish (%s); closing", exc or "timeout")
    if not nc.is_closed:
        with contextlib.suppress(TimeoutError, NatsError):
            await asyncio.wait_for(nc.close(), 1.0)


def setup_logging(config: BusConfig, role: str) -> None:
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
    )


#: Set by :func:`main`: the process is the service's own, so the watchdog may end it after
#: :func:`serve` returns too (the interpreter's teardown is part of the stop). A service run
#: inside another program (a test) has its watchdog disarmed when serve() returns.
_owns_process = False


def _arm_watchdog(role: str) -> threading.Timer:
    """Once a stop begins: end the process if it is still running after the deadline."""

    def expire() -> None:
        log.error("%s: stop took longer than %.1f s; exiting", role, STOP_DEADLINE_S)
        logging.shutdown()
        os._exit(EXIT_STOP_DEADLINE)

    timer = threading.Timer(STOP_DEADLINE_S, expire)
    timer.daemon = True
    timer.start()
    return timer


class _LoopWatch:
    """Exits the process (75) when the event loop has not ticked for ``limit_s``: the loop
    ticks a clock every second, a daemon thread reads it. Stops watching once a stop
    begins (the stop's own watchdog takes over)."""

    def __init__(self, role: str, limit_s: float) -> None:
        self.role = role
        self.limit_s = limit_s
        self.tick = time.monotonic()
        self.done = threading.Event()

    async def ticking(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.tick = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        self.done.set()

    def watch(self) -> None:
        while not self.done.wait(1.0):
            stalled_s = time.monotonic() - self.tick
            if stalled_s > self.limit_s and not self.done.is_set():
                log.critical(
                    "%s: event loop stalled for %.0f s; exiting for a restart",
                    self.role,
                    stalled_s,
                )
                logging.shutdown()
                os._exit(EXIT_RESTART)


#: How often a role says that its bus does not answer while it keeps trying.
CONNECT_ERROR_EVERY_S = 10.0

#: Connections that arrived after a stop, being closed (kept referenced until done).
_late_closes: set[asyncio.Future[None]] = set()


async def _connect_or_stop(config: BusConfig, role: str, stop: asyncio.Event) -> NATS | None:
    """Connect, unless told to stop first (None). The connect attempt is not cancelled: a
    late connection is closed as soon as it arrives."""
    tls = ssl.create_default_context(cafile=config.tls_ca) if config.tls_ca else None
    last_said = -math.inf

    async def say_why(exc: Exception) -> None:
        # Connects and reconnects are retried for ever (a role waits for its broker): say
        # why now and then, or a wrong --url looks like a role that hangs in silence.
        nonlocal last_said
        if time.monotonic() - last_said >= CONNECT_ERROR_EVERY_S:
            last_said = time.monotonic()
            log.warning("%s: the bus at %s does not answer (%s); retrying", role, config.url, exc)

    attempt = asyncio.ensure_future(
        connect(
            config.url,
            name=f"joynexus-{role}",
            creds=config.creds,
            user=config.user,
            password=config.password,
            tls=tls,
            error_cb=say_why,
        )
    )
    while not attempt.done() and not stop.is_set():
        await asyncio.wait({attempt}, timeout=0.1)
    if attempt.done():
        return attempt.result()

    def close_late(fut: asyncio.Future[NATS]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            closing = asyncio.ensure_future(fut.result().close())
            _late_closes.add(closing)
            closing.add_done_callback(_late_closes.discard)

    attempt.add_done_callback(close_late)
    return None


async def serve(
    role: str, config: BusConfig, body: Callable[[Runtime], Coroutine[Any, Any, None]]
) -> None:
    """Run ``body`` as role ``role`` until it returns or a stop signal arrives."""
    setup_logging(config, role)
    stop = asyncio.Event()
    stop_began = threading.Event()

    def request_stop() -> None:
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop)
    if stopping.requested():  # a signal arrived during start-up imports
        stop.set()

    watchdogs: list[threading.Timer] = []

    async def watch_stop() -> None:
        await stop.wait()
        if not stop_began.is_set():
            stop_began.set()
            watchdogs.append(_arm_watchdog(role))

    watcher = asyncio.ensure_future(watch_stop())
    loop_watch = None
    if _owns_process and config.loop_stall_s > 0:
        loop_watch = _LoopWatch(role, config.loop_stall_s)
        threading.Thread(target=loop_watch.watch, name="loop watch", daemon=True).start()
        ticking = asyncio.ensure_future(loop_watch.ticking(stop))
    try:
        setup_tracing(f"joynexus-{role}", trace_file=config.trace_file, environ=os.environ)
        setup_metrics(f"joynexus-{role}", config.metrics_port, config.metrics_host, os.environ)
        nc = await _connect_or_stop(config, role, stop)
        if nc is None:
            log.info("%s stopped before connecting", role)
            return
        try:
            await _serve_connected(role, config, body, nc, stop)
        finally:
            await close_connection(nc)
    finally:
        stop.set()
        await watcher
        if loop_watch is not None:
            await ticking
        await asyncio.to_thread(flush_tracing)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if not _owns_process:
            for timer in watchdogs:
                timer.cancel()


async def _serve_connected(
    role: str,
    config: BusConfig,
    body: Callable[[Runtime], Coroutine[Any, Any, None]],
    nc: NATS,
    stop: asyncio.Event,
) -> None:
    js = nc.jetstream()
    rt = Runtime(
        role,
        config,
        nc,
        js,
        config.instance or default_instance(role),
        time.time(),
        stop,
        Consumer(js, stop),
    )
    rt.in_flight = rt.consumer.in_flight
    observe_service(role, rt.instance, rt.started_at, lambda: rt.gauges())
    try:
        if not stop.is_set():
            await declare(js, BusLayout(replicas=config.replicas))
            rt.heartbeats_kv = await js.key_value(subjects.KV_HEARTBEATS)
        if stop.is_set():
            return
        log.info("%s %s started (pid %d) on %s", role, rt.instance, os.getpid(), config.url)

        async def restart(msg: Msg) -> None:
            global _restart_ordered
            try:
                order = decode(RESTART_ORDER_DECODER, msg.data)
            except DecodeError:
                return
            log.warning("restart ordered by the health manager: %s", order.reason)
            _restart_ordered = True
            stop.set()

        restarts = await nc.subscribe(restart_subject(rt.instance), cb=restart)
        async with asyncio.TaskGroup() as tasks:
            rt._tasks = tasks
            rt.spawn(_heartbeat_loop(rt), "heartbeat")
            rt.spawn(rt.consumer.keep_alive(), "keep-alive")
            rt.spawn(body(rt), f"{role} body")
        log.info("%s %s stopped", role, rt.instance)
        with contextlib.suppress(NatsError, TimeoutError):
            await asyncio.wait_for(restarts.unsubscribe(), 0.5)
    finally:
        stop.set()
        await rt.consumer.close()
        if rt.heartbeats_kv is not None:
            with contextlib.suppress(NatsError, TimeoutError):
                await asyncio.wait_for(rt.heartbeats_kv.delete(rt.heartbeat_key), 0.5)
    if rt.crash is not None:
        raise rt.crash


def main(run: Callable[[Any], Coroutine[Any, Any, None]], config: BusConfig) -> None:
    """A role's process entry: run it; exit 0 on a clean stop, 1 on a crash, 75 on a stop the
    health manager ordered (:data:`EXIT_RESTART`)."""
    global _owns_process
    _owns_process = True
    try:
        asyncio.run(run(config))
    except KeyboardInterrupt:
        pass
    except Exception:
        log.exception("service crashed")
        sys.exit(1)
    # A clean stop skips interpreter finalisation: a model load that Runtime.slow abandoned
    # may still be inside torch in its daemon thread, and torch's exit hooks then abort the
    # process ("terminate called without an active exception", exit -6).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_RESTART if _restart_ordered else 0)
