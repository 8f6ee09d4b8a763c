"""The pull-consume loop and the one function that decides a message's fate.

Fate rules (DESIGN.md §2):

* handler returned → ``ack``;
* :class:`~bus.errors.HandlerError` with ``retryable`` → ``nak`` with its delay, until the
  consumer's ``max_deliver`` is reached, then dead-letter;
* ``retryable`` False (poison: bad schema, bad shapes, unknown tenant) → ``term`` + a
  :class:`~schemas.dead.DeadLetter` on ``nexus.dead.<stream>.<tenant>`` + the ``on_dead``
  hook (which tells the tenant on ``EVENTS``);
* any other exception is a bug of ours: retried with backoff (logged with traceback), and
  dead-lettered once ``max_deliver`` is reached — never silently acked.

Long handlers get in-progress acks every ``ack_wait / 3`` so they are not redelivered while
still working.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import FetchTimeoutError, NotFoundError

from bus import tracing
from bus.codec import DecodeError, encode
from bus.errors import HandlerError
from schemas import subjects
from schemas.dead import DeadLetter
from schemas.headers import MSG_ID

log = logging.getLogger(__name__)

#: Dead letters keep at most this many payload bytes (the rest is in the source stream's
#: history only for limits streams; for work queues it is gone, so keep a generous slice).
DEAD_PAYLOAD_LIMIT = 512 * 1024

Handler = Callable[[Msg], Awaitable[None]]
DeadHook = Callable[[Msg, str, BaseException], Awaitable[None]]


class Fate(enum.Enum):
    ACKED = "acked"
    RETRY = "retry"
    DEAD = "dead"


def error_reason(error: BaseException) -> str:
    """What the sender is told: our own errors speak for themselves; others name their type."""
    if isinstance(error, HandlerError | DecodeError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _tenant_of(msg: Msg) -> str:
    tenant = subjects.tenant_of(msg.subject)
    try:
        return subjects.validate_id(tenant or "", "tenant")
    except ValueError:
        return "unknown"


async def dead_letter(
    js: JetStreamContext, msg: Msg, *, consumer: str, reason: str, error_type: str
) -> None:
    """Publish a :class:`DeadLetter` for ``msg`` (idempotent per stream sequence)."""
    meta = msg.metadata
    stream = meta.stream
    payload = msg.data or b""
    record = DeadLetter(
        stream=stream,
        subject=msg.subject,
        consumer=consumer,
        stream_seq=meta.sequence.stream,
        num_delivered=meta.num_delivered,
        reason=reason,
        error_type=error_type,
        payload=payload[:DEAD_PAYLOAD_LIMIT],
        at=time.time(),
        tenant=_tenant_of(msg),
        payload_truncated_at=DEAD_PAYLOAD_LIMIT if len(payload) > DEAD_PAYLOAD_LIMIT else 0,
    )
    await js.publish(
        subjects.dead(stream, record.tenant),
        encode(record),
        headers={MSG_ID: f"dead:{stream}:{record.stream_seq}"},
    )


async def settle(
    js: JetStreamContext,
    msg: Msg,
    error: BaseException | None,
    *,
    consumer: str,
    max_deliver: int,
    on_dead: DeadHook | None = None,
) -> Fate:
    """Decide and carry out ``msg``'s fate after handling ended with ``error`` (None: ok).
    This is the only place in the code base that acks, naks or terminates on a consumer."""
    if error is None:
        await msg.ack()
        return Fate.ACKED
    delivered = msg.metadata.num_delivered
    if isinstance(error, HandlerError | DecodeError):
        retryable = isinstance(error, HandlerError) and error.retryable
        delay = error.delay_s if isinstance(error, HandlerError) else 0.0
    else:
        log.error(
            "unexpected error handling %s (delivery %d)", msg.subject, delivered, exc_info=error
        )
        retryable, delay = True, min(30.0, 0.5 * 2 ** (delivered - 1))
    if retryable and (max_deliver <= 0 or delivered < max_deliver):
        await msg.nak(delay=delay)
        return Fate.RETRY
    reason = error_reason(error)
    if retryable:
        reason = f"gave up after {delivered} deliveries: {reason}"
    await dead_letter(js, msg, consumer=consumer, reason=reason, error_type=type(error).__name__)
    await msg.term()
    if on_dead is not None:
        try:
            await on_dead(msg, reason, error)
        except Exception:
            log.exception("on_dead hook failed for %s", msg.subject)  # block the consumer
    return Fate.DEAD


@dataclass
class PullConsumer:
    """A durable pull consumer with a per-message handler.

    ``run(stop)`` fetches in batches until ``stop`` is set; messages fetched but not started
    when stopping are released (nak without delay) for another instance.
    """

    js: JetStreamContext
    stream: str
    durable: str
    filter_subject: str
    handler: Handler
    max_deliver: int = 5
    ack_wait_s: float = 30.0
    batch: int = 32
    fetch_timeout_s: float = 0.5
    max_ack_pending: int = 1000
    on_dead: DeadHook | None = None
    #: Messages handled at once (long-running tasks such as dataset streams need > 1).
    concurrency: int = 1
    #: Messages currently being handled (reported in heartbeats).
    in_flight: int = 0

    def config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.durable,
            filter_subject=self.filter_subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            max_ack_pending=self.max_ack_pending,
        )

    async def subscribe(self) -> JetStreamContext.PullSubscription:
        try:
            await self.js.consumer_info(self.stream, self.durable)
        except NotFoundError:
            await self.js.add_consumer(self.stream, self.config())
        return await self.js.pull_subscribe_bind(self.durable, stream=self.stream)

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.subscribe()
        if self.concurrency > 1:
            await self._run_concurrent(sub, stop)
            return
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(self.batch, timeout=self.fetch_timeout_s)
                except (TimeoutError, FetchTimeoutError, NatsTimeoutError):
                    continue
                for i, msg in enumerate(msgs):
                    if stop.is_set():
                        for rest in msgs[i:]:
                            await rest.nak()
                        break
                    await self.handle(msg)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _run_concurrent(
        self, sub: JetStreamContext.PullSubscription, stop: asyncio.Event
    ) -> None:
        """Up to ``concurrency`` handlers at once; only fetch what can start now. On stop,
        running handlers are cancelled, which hands their messages back (nak)."""
        running: set[asyncio.Task[Fate]] = set()
        try:
            while not stop.is_set():
                running = {t for t in running if not t.done()}
                free = self.concurrency - len(running)
                if free <= 0:
                    stop_wait = asyncio.create_task(stop.wait())
                    await asyncio.wait({*running, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                    stop_wait.cancel()
                    continue
                try:
                    msgs = await sub.fetch(min(free, self.batch), timeout=self.fetch_timeout_s)
                except (TimeoutError, FetchTimeoutError, NatsTimeoutError):
                    continue
                for msg in msgs:
                    running.add(asyncio.create_task(self.handle(msg)))
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def handle(self, msg: Msg) -> Fate:
        """Run the handler with in-progress acks, then settle the message."""
        self.in_flight += 1
        ticker = asyncio.create_task(self._keep_alive(msg))
        error: BaseException | None = None
        try:
            with tracing.consumer_span(f"{self.durable} {msg.subject}", msg.headers):
                await self.handler(msg)
        except asyncio.CancelledError:
            # Shutting down mid-message: hand it back for redelivery, then propagate.
            ticker.cancel()
            self.in_flight -= 1
            with contextlib.suppress(Exception):
                await msg.nak()
            raise
        except Exception as exc:  # noqa: BLE001 - every exception's fate is decided by settle()
            error = exc
        ticker.cancel()
        try:
            return await settle(
                self.js,
                msg,
                error,
                consumer=self.durable,
                max_deliver=self.max_deliver,
                on_dead=self.on_dead,
            )
        finally:
            self.in_flight -= 1

    async def _keep_alive(self, msg: Msg) -> None:
        interval = max(0.5, self.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            await msg.in_progress()
