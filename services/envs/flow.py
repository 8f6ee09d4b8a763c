"""Event-driven backpressure for a dataset stream: follow the trainer's committed progress on
the job (its ``policies`` KV entry, written at every commit) instead of asking the broker for
the stream's state before every batch and sleeping when throttled.

A stream may have at most ``max_in_flight`` of its tenant's batches in ``TRAIN`` (unconsumed,
or applied and awaiting their checkpoint's commit: the trainer acks a batch only once a
checkpoint holds it). :class:`Flow` estimates that count as what was in ``TRAIN`` at the last
exact reading plus what the stream published since, minus what the trainer committed since,
and wakes a throttled stream the moment a commit lands. The exact count (one ``stream_info``
request) is read only at the start and when a wait runs out without a commit (a watch that
missed an update, or a trainer that is down), so an estimate that drifted is corrected.

The KV watch is polled with a short timeout and stopped by an event, never cancelled
(PITFALLS: a cancel inside nats.py's ``wait_for`` can be lost on Python 3.11).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from nats.errors import Error as NatsError
from nats.js.kv import KeyValue

from bus.codec import DecodeError, decode
from schemas.jobs import job_key
from schemas.train import POLICY_RECORD_DECODER

log = logging.getLogger(__name__)

#: How often the watch looks at its stop event while the job is quiet.
POLL_S = 0.25
#: A throttled stream waits this long for a commit before reading the exact count.
RESYNC_S = 1.0


class Flow:
    """One stream's in-flight estimate, driven by the job's committed ``batches_done``.

    ``exact`` reads the tenant's unconsumed count in ``TRAIN`` (one request); ``step`` is
    where the stream starts, ``committed`` the trainer's committed batches at that point.
    """

    def __init__(
        self,
        policies: KeyValue,
        tenant: str,
        job_id: str,
        exact: Callable[[], Awaitable[int]],
    ) -> None:
        self.policies = policies
        self.key = job_key(tenant, job_id)
        self.exact = exact
        self.committed = 0
        self.changed = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Future[None] | None = None
        # The estimate: in TRAIN at the last exact reading, and published/committed since.
        self._base = 0
        self._published = 0
        self._committed_at_base = 0

    async def start(self, committed: int) -> None:
        """Start following the job's commits; read the exact count once."""
        self.committed = committed
        await self.resync()
        self._task = asyncio.ensure_future(self._follow())

    async def close(self) -> None:
        """Stop the watch (bounded)."""
        self._stop.set()
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=2 * POLL_S + 0.5)

    def published(self) -> None:
        """The stream published one more batch."""
        self._published += 1

    @property
    def in_flight(self) -> int:
        """Estimated batches of the tenant in ``TRAIN`` (never below zero)."""
        return max(0, self._base + self._published - (self.committed - self._committed_at_base))

    async def resync(self) -> None:
        """Replace the estimate by the exact count."""
        self._base = await self.exact()
        self._published = 0
        self._committed_at_base = self.committed

    async def wait_below(self, limit: int, stop: asyncio.Event) -> None:
        """Return once fewer than ``limit`` are in flight, at the next commit (or at a stop,
        or after :data:`RESYNC_S`: then with the exact count, which may still be at the
        limit; the caller checks again)."""
        if self.in_flight < limit:
            return
        self.changed.clear()
        waits = {
            asyncio.ensure_future(self.changed.wait()),
            asyncio.ensure_future(stop.wait()),
        }
        try:
            done, _ = await asyncio.wait(waits, timeout=RESYNC_S, return_when="FIRST_COMPLETED")
        finally:
            for w in waits:  # Event.wait() holds no nats call: cancelling it is safe
                w.cancel()
        if not done:
            await self.resync()

    def _observe(self, entry: KeyValue.Entry) -> None:
        if entry.value is None:
            return
        try:
            record = decode(POLICY_RECORD_DECODER, entry.value)
        except DecodeError as exc:
            log.warning("unreadable policy record %s: %s", self.key, exc)
            return
        if record.batches_done > self.committed:
            self.committed = record.batches_done
            self.changed.set()

    async def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                watcher = await self.policies.watch(self.key)
            except (NatsError, TimeoutError, OSError) as exc:
                log.warning("watch on %s failed to start (%s); trying again", self.key, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), RESYNC_S)
                continue
            try:
                while not self._stop.is_set():
                    try:
                        entry = await watcher.updates(timeout=POLL_S)
                    except (NatsError, TimeoutError):  # nothing new
                        continue
                    if entry is not None:
                        self._observe(entry)
            finally:
                with contextlib.suppress(NatsError, TimeoutError, OSError):
                    await asyncio.wait_for(watcher.stop(), 0.5)
