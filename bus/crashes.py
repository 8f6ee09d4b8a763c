"""The crash ledger: poison that kills its handler's process, caught without trusting the
server's delivery counts.

A message whose handling kills the process (a simulator that segfaults on one seed, an
out-of-memory batch, a hang the health manager ends) never raises into the consume runtime,
so :meth:`bus.consume.Consumer.settle` never sees it: the server redelivers it to the
restarted role, which dies again. ``max_deliver`` alone would end that loop, but the
server's ``num_delivered`` can roll back after a broker crash (PITFALLS: a redelivered
message showed ``num_delivered == 1``), and at the server's last delivery no one is left to
dead-letter it or tell its sender.

So every *redelivery* (``num_delivered`` > 1: the first delivery is not suspect and costs
nothing) is written down before it is handled, in the ``crashes`` KV bucket under
``<stream>.<durable>.<stream seq>``: the count of consecutive deliveries that started and
were never settled. Settling the message (whatever its fate) deletes the key. A message
whose count passes the consumer's ``max_crashes`` is dead-lettered without being handled
again (:class:`CrashLoopError`), with a reason its sender is told. The count lives in its
own stream, apart from the consumer's state, so a rolled-back delivery counter does not
reset it: a rollback costs at most the one delivery that showed ``num_delivered == 1``.

A consumer that handles several messages at once counts every message in flight when its
process dies, the innocent beside the poison; so a message with a count already (a
*suspect*) is handled alone (:meth:`bus.consume.Consumer.run`), counted only when it starts:
only the poison's count then keeps rising. A role that holds messages long past the work
that uses them (the trainer: prefetched steps, applied ones waiting for their commit) fetches
them uncounted, counts each when its work starts and takes that start back when the work
returns (:meth:`CrashLedger.undo`; :mod:`services.trainer.crashguard`): a crash then counts
only the work that was running. A message handed back unsettled (a stop, a deferral) has its
start taken back the same way, and the crashes before it stay counted for the next instance.

A suspect's preparation may run beside other work, uncounted, when a *mark* records it
(:meth:`CrashLedger.begin_preparing`; the inferencer loads a suspect's policy this way while
it serves the other jobs): a mark still there at the next start means the preparation never
returned, and the suspect then prepares inside its counted run alone. A crash beside an
uncounted preparation is charged to nobody's count but the work that was counted, and a
poison preparation costs one restart more.

The bucket has a TTL (a day, :class:`bus.declare.BusLayout`): a key left by a message that
was purged or deleted otherwise goes away on its own (so does a mark).
"""

from __future__ import annotations

import logging

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import (
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from bus.errors import PoisonError
from schemas import subjects

log = logging.getLogger(__name__)


class CrashLoopError(PoisonError):
    """The message's handling ended without a fate too many times in a row (the role died
    or was killed while handling it): it is dead-lettered instead of handled again."""


#: Suffix of the key that marks a message's uncounted preparation as started.
PREPARING = ".preparing"


def ledger_key(msg: Msg) -> str:
    meta = msg.metadata
    return f"{meta.stream}.{meta.consumer}.{meta.sequence.stream}"


class CrashLedger:
    """Counts, per redelivered message, the deliveries that started and never settled."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._kv: KeyValue | None = None
        self._missing = False
        #: Keys this process wrote, with the count it wrote (deleted when their message
        #: settles).
        self._written: dict[str, int] = {}
        #: Keys whose latest start this process counted and has not taken back: only those
        #: may be taken back (:meth:`undo`), so a start that was never counted (the ledger
        #: away) cannot erase one that was.
        self._started: set[str] = set()

    async def _bucket(self) -> KeyValue | None:
        if self._kv is None and not self._missing:
            try:
                self._kv = await self.js.key_value(subjects.KV_CRASHES)
            except NotFoundError:
                # A bus declared by an older version: redeliveries go uncounted (max_deliver
                # still ends a crash loop), said once.
                self._missing = True
                bucket = subjects.KV_CRASHES
                log.warning("no %s bucket: crash loops are left to max_deliver", bucket)
        return self._kv

    async def begin(self, msg: Msg) -> int:
        """Record that ``msg``'s handling starts; its count of unsettled starts, this one
        included (0 for a first delivery, which is not recorded)."""
        if msg.metadata.num_delivered <= 1:
            return 0
        key = ledger_key(msg)
        # Only the one handler of this delivery writes its key (the previous one is gone, or
        # its ack wait passed), so a read then a put is enough.
        try:
            # Finding the bucket is a JetStream API request too: while a cluster elects a new
            # leader (a node killed) it times out, and that must not end the consumer.
            kv = await self._bucket()
            if kv is None:
                return 0
            try:
                count = int((await kv.get(key)).value or b"0") + 1
            except (KeyNotFoundError, KeyDeletedError):
                count = 1
            await kv.put(key, str(count).encode())
        except (NatsError, TimeoutError, ValueError) as exc:
            # Counting is a guard, not a gate: the message is handled uncounted. What the
            # key holds is unknown now (a put may have landed unanswered): this process
            # neither takes a start back from it nor clears it (it expires with the bucket's
            # TTL).
            log.warning("crash ledger: could not count %s: %s", key, exc)
            self._forget(key)
            return 0
        self._written[key] = count
        self._started.add(key)
        return count

    async def peek(self, msg: Msg) -> int:
        """``msg``'s count of unsettled starts so far, without counting this delivery (0 for
        a first delivery, or when the ledger cannot be read)."""
        if msg.metadata.num_delivered <= 1:
            return 0
        try:
            kv = await self._bucket()
            if kv is None:
                return 0
            return int((await kv.get(ledger_key(msg))).value or b"0")
        except (KeyNotFoundError, KeyDeletedError):
            return 0
        except (NatsError, TimeoutError, ValueError) as exc:
            log.warning("crash ledger: could not read %s: %s", ledger_key(msg), exc)
            return 0

    async def end(self, msg: Msg) -> None:
        """``msg`` settled: forget its count (only if this process wrote one)."""
        if not self._written:  # the common case: nothing redelivered in flight
            return
        key = ledger_key(msg)
        if key not in self._written or self._kv is None:
            return
        self._forget(key)
        try:
            await self._kv.delete(key)
        except (NatsError, TimeoutError) as exc:
            log.info("crash ledger: could not clear %s: %s", key, exc)

    async def undo(self, msg: Msg) -> None:
        """``msg``'s latest start returned (the process survived it), though the message is
        not settled (held until its effect is durable): take that start back from its
        count, which keeps the starts that never returned (only a start this process
        counted, once)."""
        if not self._started:  # the common case: no counted start in flight
            return
        key = ledger_key(msg)
        if key not in self._started or self._kv is None:
            return
        self._started.discard(key)
        count = self._written.get(key, 1) - 1
        try:
            if count <= 0:
                await self._kv.delete(key)
            else:
                await self._kv.put(key, str(count).encode())
        except (NatsError, TimeoutError) as exc:
            # The start stays counted (a crash too many, at worst): never less than the
            # starts that did not return.
            log.info("crash ledger: could not take a start back from %s: %s", key, exc)
            return
        if key not in self._written or key in self._started:
            return  # settled meanwhile (end() cleared it), or started again (begin() wrote it)
        if count <= 0:
            del self._written[key]
        else:
            self._written[key] = count

    async def handed_back(self, msg: Msg, *, still_running: bool = False) -> None:
        """``msg`` goes back to the server unsettled, its work not done (a stop, a
        deferral): a start of it still counted is taken back (the process survived it) unless
        its handling is ``still_running`` (a stop that could not wait for it: a hang counts
        like a crash), and the crashes before it stay counted for whoever handles it next
        (clearing them would start a poison's count again at every scale-down)."""
        if not self._written:
            return
        if not still_running:
            await self.undo(msg)
        self._forget(ledger_key(msg))

    async def begin_preparing(self, msg: Msg) -> bool:
        """Mark that ``msg``'s preparation (work before its handling, uncounted, beside other
        work) starts; False, and nothing marked, if a mark of an earlier start is there (that
        preparation never returned: the process died in it) or the ledger cannot tell: the
        message must then prepare inside its counted handling."""
        key = f"{ledger_key(msg)}{PREPARING}"
        try:
            kv = await self._bucket()
            if kv is None:
                return False
            await kv.create(key, b"1")
        except KeyWrongLastSequenceError:
            return False  # marked by a start that never returned
        except (NatsError, TimeoutError) as exc:
            log.warning("crash ledger: could not mark %s: %s", key, exc)
            return False
        return True

    async def end_preparing(self, msg: Msg) -> None:
        """``msg``'s preparation returned: its mark goes (kept, until the bucket's TTL, if it
        cannot be deleted: the message then prepares inside its counted handling)."""
        if self._kv is None:
            return
        key = f"{ledger_key(msg)}{PREPARING}"
        try:
            await self._kv.delete(key)
        except (NatsError, TimeoutError) as exc:
            log.info("crash ledger: could not clear %s: %s", key, exc)

    def keep_counted(self, msg: Msg) -> None:
        """``msg``'s latest start stays counted: its work raised out of a role that ends on
        it (a bug, where failures should be values), which counts as a crash would (neither
        taken back nor cleared by this process)."""
        self._forget(ledger_key(msg))

    def _forget(self, key: str) -> None:
        """Leave ``key`` to others: this process neither takes a start back from it nor
        clears it any more."""
        self._written.pop(key, None)
        self._started.discard(key)
