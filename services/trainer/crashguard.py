"""The trainer's side of the crash ledger (:mod:`bus.crashes`): a message counts as started
when the work that uses it starts (its round's step, its iteration's RL update, a session
call applied at triage, the restore of its job's slot, the writing of the version that
covers it), not when it is fetched, and that start is taken back when the work returns,
though the message stays held until its commit.

The trainer buffers and holds many messages of every tenant at once (prefetched steps,
applied steps waiting for their commit, an iteration's episodes). Counted at fetch, all of
them climbed together at every crash: a batch that kills the process (an out-of-memory step,
a crash in a kernel) took the steps and episodes of every other tenant in flight to the crash
limit with it, and their jobs failed beside its own. Now a crash counts only the messages of
the work that was running; and work holding a message counted already (a *suspect*: it ran when the
process died) runs alone, the least counted first, so that only the poison's count climbs
until it is dead-lettered (its job fails with :class:`~bus.crashes.CrashLoopError`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import TypeVar

from nats.aio.msg import Msg

from bus.consume import Consumer

K = TypeVar("K")


class DeadLettered(Exception):
    """Raised instead of starting work whose message was dead-lettered as it began (its
    handling killed the process too many times in a row): the message is settled already
    (its sender told) and must not be used."""


class CrashGuard:
    """What the trainer's work tells the crash ledger, through the consume runtime."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    async def suspect(self, groups: Mapping[K, Sequence[Msg]]) -> K | None:
        """The group (a tenant's step, a job's iteration) that must run alone: the one
        holding a message the ledger counts already, the least counted first; None when no
        group does (the common case costs nothing: first deliveries are never counted)."""
        redelivered = [
            (key, msg)
            for key, msgs in groups.items()
            for msg in msgs
            if msg.metadata.num_delivered > 1
        ]
        if not redelivered:
            return None
        counts = await asyncio.gather(*(self.consumer.crashes.peek(m) for _, m in redelivered))
        most: dict[K, int] = {}
        for (key, _), count in zip(redelivered, counts, strict=True):
            if count > 0:
                most[key] = max(most.get(key, 0), count)
        return min(most, key=most.__getitem__) if most else None

    async def begin(self, msgs: Iterable[Msg]) -> list[Msg]:
        """Count the redelivered ones among ``msgs`` as started; return those whose work began
        too many times in a row without returning: they are dead-lettered here (settled, the
        sender told) and must not be used."""
        redelivered = [m for m in msgs if m.metadata.num_delivered > 1]
        if not redelivered:
            return []
        consumer = self.consumer
        kept = await asyncio.gather(
            *(
                consumer.begin_redelivered(consumer.durables[m.metadata.consumer], m)
                for m in redelivered
            )
        )
        return [m for m, keep in zip(redelivered, kept, strict=True) if not keep]

    async def returned(self, msgs: Iterable[Msg]) -> None:
        """The work using ``msgs`` returned (whatever its outcome): the process survived it,
        so that start is taken back from their counts (the messages stay held until their
        commit; the crashes they were in flight for still count)."""
        await asyncio.gather(*(self.consumer.crashes.undo(m) for m in msgs))

    def raised(self, msgs: Iterable[Msg]) -> None:
        """The work using ``msgs`` raised out of the trainer (a bug: a tenant's failure is a
        value), which ends the process: their start stays counted, as a crash's would, so
        that the restarted trainer runs that work alone and only its poison climbs to the
        crash limit, instead of raising again with every restart for as long as the server
        redelivers."""
        for msg in msgs:
            self.consumer.crashes.keep_counted(msg)

    @contextlib.asynccontextmanager
    async def started(self, msg: Msg) -> AsyncIterator[None]:
        """Count the block as work ``msg`` started, taken back when it returns (raised
        included); raises :class:`DeadLettered` instead of entering it when ``msg`` was
        dead-lettered as it began."""
        if await self.begin([msg]):
            raise DeadLettered
        try:
            yield
        finally:
            await self.returned([msg])
