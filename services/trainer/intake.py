"""The trainer's intake: per-tenant prefetch buffers filled from the tenants' durables.

Every fetched message is held by the consume runtime at once (kept alive with in-progress
acks while it waits in a buffer) and decoded once; it leaves its buffer when it is settled,
held for a commit, or chosen for a step.

Each message is checked here, before it meets its job (:mod:`services.trainer.checks`): its
size, its tenant against its subject's, and every tensor's dtype, shape and finiteness
within the operator's :class:`~schemas.limits.InputLimits`. TRAIN subjects
(``nexus.train.<backbone>.<tenant>``) carry control messages (``OpenSlot``, ``CloseSlot``)
as well as data; tenants have no publish permission on ``nexus.train.>`` (the broker
enforces it: only the service identity — the master and env workers — may publish there),
so a control message here comes from a service. A message addresses only its own tenant's
jobs: jobs are keyed by (tenant, job), and the tenant is the subject's."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

from nats.aio.msg import Msg

from bus.codec import DecodeError, decode
from bus.consume import Consumer
from bus.durables import DurableSet
from bus.errors import HandlerError, PoisonError
from bus.payloads import PayloadGoneError, discard, fetch_train
from schemas.limits import InputLimits, exceeds
from schemas.train import TRAIN_DECODER, OpenSlot, PayloadRef, RolloutBatch, SFTBatch
from services.trainer.checks import check_open_slot, check_rollout, check_sft

log = logging.getLogger(__name__)

#: Most messages buffered per tenant, waiting ones included (the default).
MAX_BUFFER = 256
#: Most bytes buffered per tenant (the default): a prefetch of large batches, with room for
#: those that wait; without it 256 messages of up to ``max_message_bytes`` (8 MiB) each
#: could be buffered for every tenant.
MAX_BUFFER_BYTES = 256 << 20

#: A stuck buffer (full, every message waiting) hands messages back at most this often: the
#: one they wait for is usually a redelivery, fetched first once due, so a few free places
#: are enough, and a stall does not turn into a loop re-fetching the backlog.
ROOM_EVERY_S = 1.0
#: A stuck buffer with nothing left to hand back fetches past its bound a prefetch at a
#: time up to this many times ``max_buffer``; past that one message a second (and says so).
OVERFLOW_FACTOR = 2
#: A handed-back waiting message comes back after 2**deliveries seconds, at most this long.
MAX_DEFER_S = 60.0


class Waiting:
    """A buffered body that must wait (a later step or iteration, or a slot not open yet)."""

    __slots__ = ("body",)

    def __init__(self, body: object) -> None:
        self.body = body


@dataclass(frozen=True)
class MissingPayload:
    """A reference whose object is gone. Its object is deleted once its message is
    acknowledged, so a redelivery of an acknowledged message (a lost ack) finds none: the
    trainer recognises it by the reference's step as already applied; anything else fails
    with ``error``."""

    ref: PayloadRef
    error: PoisonError

    @property
    def tenant(self) -> str:
        return self.ref.tenant

    @property
    def job_id(self) -> str:
        return self.ref.job_id


class Intake:
    """Per tenant: fetched messages with their decoded bodies (or the error each will be
    dead-lettered with), in arrival order."""

    def __init__(
        self,
        consumer: Consumer,
        tenants: DurableSet,
        prefetch: int,
        limits: InputLimits | None = None,
        max_buffer: int = MAX_BUFFER,
        *,
        max_buffer_bytes: int = MAX_BUFFER_BYTES,
    ) -> None:
        self.consumer = consumer
        self.tenants = tenants
        self.prefetch = prefetch
        self.limits = limits or InputLimits()
        self.max_buffer = max_buffer
        self.max_buffer_bytes = max_buffer_bytes
        self.buffers: dict[str, list[tuple[Msg, object]]] = {}
        #: Bytes each buffered message stands for (a reference: its payload's size), by the
        #: message's identity: written for every message as it is fetched (an identity can
        #: be reused once a message is gone), forgotten at the next fill once it left.
        self._sizes: dict[int, int] = {}
        #: When each tenant's stuck buffer may next hand messages back (monotonic).
        self._room_at: dict[str, float] = {}

    def add_tenant(self, tenant: str) -> None:
        self.buffers.setdefault(tenant, [])

    @property
    def busy(self) -> bool:
        return any(self.buffers.values())

    def buffered_bytes(self, tenant: str) -> int:
        """Bytes of the messages in ``tenant``'s buffer (references at their payload's size)."""
        return sum(self._sizes.get(id(msg), len(msg.data)) for msg, _ in self.buffers[tenant])

    def _full(self, tenant: str) -> bool:
        return (
            len(self.buffers[tenant]) >= self.max_buffer
            or self.buffered_bytes(tenant) >= self.max_buffer_bytes
        )

    def stocked(self, tenants: set[str]) -> bool:
        """Whether every one of ``tenants`` has a message buffered (one that waited for the
        step just applied is next now)."""
        return all(self.buffers.get(t) for t in tenants)

    async def fill(self, live: set[str], linger: bool = True) -> int:
        """Top up the buffers of tenants with messages or with live jobs (fetches run at
        once). Only when no tenant has work buffered (and ``linger``) is it worth waiting
        for messages. Returns how many messages arrived."""
        buffered = {id(msg) for buf in self.buffers.values() for msg, _ in buf}
        self._sizes = {key: size for key, size in self._sizes.items() if key in buffered}
        wants = {}
        for tenant in self.buffers:
            past_bounds = await self.make_room(tenant)
            buf = self.buffers[tenant]
            waiting = sum(1 for _, item in buf if isinstance(item, Waiting))
            # Batches waiting for an earlier step do not use up the prefetch: the earlier
            # step must still be fetched. max_buffer and max_buffer_bytes bound memory all
            # the same.
            if past_bounds:
                room = past_bounds
            elif self.buffered_bytes(tenant) >= self.max_buffer_bytes:
                room = 0
            else:
                room = self.max_buffer - len(buf)
            wants[tenant] = min(self.prefetch - (len(buf) - waiting), room)
        wait = 0.05 if linger and not self.busy else 0.001
        # Counted in the crash ledger when the work that uses them starts, not here
        # (services.trainer.crashguard).
        fetched = await self.tenants.fill(wants, wait, also=live, count_crashes=False)
        arrived = 0
        for msgs in fetched.values():
            for msg in msgs:
                self.consumer.hold(msg)  # kept alive while buffered; settled exactly once
        for tenant, msgs in fetched.items():
            for msg in msgs:
                self._sizes[id(msg)] = len(msg.data)  # a reference's: set by decode()
                # Decoding may fetch a referenced payload: the others are held meanwhile.
                self.buffers[tenant].append((msg, await self.decode(tenant, msg)))
            arrived += len(msgs)
        return arrived

    async def make_room(self, tenant: str) -> int:
        """A buffer full of messages that all wait (later steps, a slot whose OpenSlot is
        being redelivered) would fetch nothing more, and the message they wait for (a step
        being retried, that OpenSlot) would never be fetched: the tenant's jobs would stop for
        good. So the latest-queued waiting ones are handed back, to be redelivered after a
        delay, making room for a prefetch's worth of others (at most every
        :data:`ROOM_EVERY_S`). A message is handed back only while it has more than half its
        deliveries left (the rest are its retries); when none has, the buffer may take a
        prefetch more instead, up to :data:`OVERFLOW_FACTOR` times its bounds, then one more
        a second (returned: how many it may fetch past its bounds now; 0: none). Full is
        either bound: ``max_buffer`` messages or ``max_buffer_bytes`` bytes."""
        buf = self.buffers[tenant]
        if not self._full(tenant) or not all(isinstance(i, Waiting) for _, i in buf):
            return 0
        now = time.monotonic()
        if now < self._room_at.get(tenant, 0.0):
            return 0
        self._room_at[tenant] = now + ROOM_EVERY_S
        waiting = [
            (msg.metadata.sequence.stream, i)
            for i, (msg, _) in enumerate(buf)
            if self.consumer.deferrable(msg)
        ]
        if not waiting:
            if (
                len(buf) >= OVERFLOW_FACTOR * self.max_buffer
                or self.buffered_bytes(tenant) >= OVERFLOW_FACTOR * self.max_buffer_bytes
            ):
                # Still one a second: a due redelivery (the awaited step) or a CloseSlot
                # comes first, so the tenant recovers when it can.
                log.error(
                    "%s: %d buffered messages wait for one that has not come; fetching one "
                    "a second (a job waits for a step that will not come?)",
                    tenant,
                    len(buf),
                )
                return 1
            log.warning(
                "%s: %d buffered messages wait for one not fetched and none can be handed "
                "back; fetching past the buffer's bound",
                tenant,
                len(buf),
            )
            return self.prefetch
        room = min(self.prefetch, len(waiting))
        latest = {i for _, i in sorted(waiting)[-room:]}
        handed = [buf[i][0] for i in sorted(latest)]
        self.buffers[tenant] = [entry for i, entry in enumerate(buf) if i not in latest]
        most = max(m.metadata.num_delivered for m in handed)
        delay = min(MAX_DEFER_S, 2.0**most)
        log.info(
            "%s: %d buffered messages wait for one not fetched; the %d latest come back in %.0f s",
            tenant,
            len(buf),
            room,
            delay,
        )
        await self.consumer.hand_back(handed, delay_s=delay)
        # Still over the byte bound (the latest were small): a prefetch may come in now, as
        # it may when the count bound made the room.
        return self.prefetch if self.buffered_bytes(tenant) >= self.max_buffer_bytes else 0

    async def decode(self, tenant: str, msg: Msg) -> object:
        """The message's body, or the error it will be settled with. A
        :class:`~schemas.train.PayloadRef` is resolved here to the message it stands for
        (its object deleted once that message is acknowledged)."""
        with self.consumer.span(msg):
            limit = self.limits.max_message_bytes
            if len(msg.data) > limit:
                size = f"{len(msg.data)} bytes"
                return PoisonError(exceeds("training message", size, "max_message_bytes", limit))
            try:
                body = decode(TRAIN_DECODER, msg.data)
            except DecodeError as exc:
                return PoisonError(f"malformed training message: {exc}")
            if body.tenant != tenant:
                return PoisonError(
                    f"message for tenant {body.tenant!r} on tenant {tenant!r}'s subject"
                )
            if isinstance(body, PayloadRef):
                ref = body
                self._sizes[id(msg)] = ref.size  # what it stands for (checked when fetched)
                try:
                    body = await self.dereference(ref)
                except PayloadGoneError as exc:
                    what = f"{ref.kind} of job {ref.job_id!r} by reference: {exc}"
                    return MissingPayload(ref, PoisonError(what))
                except HandlerError as exc:
                    return type(exc)(f"{ref.kind} of job {ref.job_id!r} by reference: {exc}")
                self.consumer.when_acked(msg, functools.partial(discard, self.consumer.js, ref))
            try:
                match body:
                    case SFTBatch():
                        check_sft(body, self.limits)
                    case RolloutBatch():
                        check_rollout(body, self.limits)
                    case OpenSlot():
                        check_open_slot(body, self.limits)
            except PoisonError as exc:
                return PoisonError(f"{type(body).__name__} of job {body.job_id!r}: {exc}")
            return body

    async def dereference(self, ref: PayloadRef) -> SFTBatch | RolloutBatch:
        """The message ``ref`` stands for: fetched, its size and digest checked, and it must
        be the kind, tenant and job the reference names."""
        data = await fetch_train(self.consumer.js, ref, self.limits.max_message_bytes)
        try:
            body = decode(TRAIN_DECODER, data)
        except DecodeError as exc:
            raise PoisonError(f"the stored message is malformed: {exc}") from exc
        if (
            not isinstance(body, SFTBatch | RolloutBatch)
            or type(body).__struct_config__.tag != ref.kind
            or (body.tenant, body.job_id) != (ref.tenant, ref.job_id)
        ):
            raise PoisonError(
                f"the stored message is a {type(body).__name__} of "
                f"{body.tenant}/{body.job_id}, not the {ref.kind} of {ref.tenant}/{ref.job_id} "
                "its reference names"
            )
        return body

    def remove(self, tenant: str, msg: Msg) -> None:
        self.buffers[tenant] = [(m, b) for m, b in self.buffers[tenant] if m is not msg]
