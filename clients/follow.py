"""Following one job's events over ``EVENTS``: a push consumer the tenant may create on its
own events only, recreated after a stall or a gap without skipping or repeating an event."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import subjects


class EventFollower:
    """One job's events from the first, in order, through a push consumer on ``EVENTS``.

    The consumer is created with a fresh name and a single filter subject, so nats.py asks
    ``$JS.API.CONSUMER.CREATE.EVENTS.<name>.nexus.event.<tenant>.<job>.>`` — the one form a
    tenant's permissions allow, on its own events only — and it delivers to the connection's
    own inbox. It needs no acks and no pull (tenants get no ``MSG.NEXT``). The server sends
    an idle heartbeat every ``heartbeat_s``; when nothing at all arrives for three of them
    (the consumer was lost: a broker restart, a deletion) or a delivery skips a sequence,
    the follower makes a new consumer, under a new name (nats.py's ordered consumer reuses
    its name, which the server refuses while the old consumer lives), starting after the
    last stream sequence it returned, so nothing is skipped or repeated.
    """

    def __init__(self, nc: NATS, tenant: str, job_id: str, heartbeat_s: float = 2.0) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.filter = subjects.events_of_job(tenant, job_id)
        self.job_id = job_id
        self.heartbeat_s = heartbeat_s
        self.sub: Subscription | None = None
        self.consumer = ""
        #: Stream sequence of the last event returned; consumer sequence of the last seen.
        self.last_stream_seq = 0
        self.last_consumer_seq = 0
        #: Consumers created after the first (each a recovery from a stall or a gap).
        self.resets = -1

    async def _create(self) -> None:
        await self._drop()
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        start = self.last_stream_seq + 1
        config = ConsumerConfig(
            name=uuid.uuid4().hex,
            deliver_subject=inbox,
            filter_subject=self.filter,
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL if start == 1 else DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=None if start == 1 else start,
            idle_heartbeat=self.heartbeat_s,
            # Left behind by a reset or a closed client, it goes by itself (tenants may not
            # delete consumers).
            inactive_threshold=max(10.0, 5 * self.heartbeat_s),
            mem_storage=True,
            num_replicas=1,
        )
        try:
            info = await self.js.add_consumer(subjects.STREAM_EVENTS, config=config)
        except BaseException:
            await sub.unsubscribe()
            raise
        self.sub, self.consumer = sub, info.name or ""
        self.last_consumer_seq = 0
        self.resets += 1

    async def _drop(self) -> None:
        if self.sub is not None:
            sub, self.sub = self.sub, None
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()

    async def next(self, timeout: float) -> Msg:
        """The next event message; TimeoutError if none comes within ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"no event from job {self.job_id} in {timeout:g}s")
            if self.sub is None:
                try:
                    await self._create()
                except (NatsError, TimeoutError):  # the broker is away: try again shortly
                    await asyncio.sleep(min(remaining, self.heartbeat_s))
                    continue
            assert self.sub is not None
            try:
                msg = await self.sub.next_msg(timeout=min(remaining, 3 * self.heartbeat_s))
            except NatsTimeoutError:
                if loop.time() < deadline:
                    await self._drop()  # not even a heartbeat: the consumer is gone
                continue
            if msg.headers and msg.headers.get("Status") == "100":  # heartbeat / flow control
                last = msg.headers.get("Nats-Last-Consumer")
                if last is not None and int(last) > self.last_consumer_seq:
                    await self._drop()  # a delivery was missed
                elif msg.reply:
                    await self.nc.publish(msg.reply)
                continue
            try:
                sequence = msg.metadata.sequence
            except (ValueError, IndexError, NatsError):
                continue  # not a JetStream delivery
            if sequence.consumer != self.last_consumer_seq + 1:
                await self._drop()
                continue
            self.last_consumer_seq = sequence.consumer
            self.last_stream_seq = sequence.stream
            return msg

    async def close(self) -> None:
        await self._drop()
