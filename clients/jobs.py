"""A submitted job as the tenant SDK hands it back: its events from the first, and how it
ended (:class:`JobResult`, or :class:`JobFailed` when it did not succeed)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bus.codec import DecodeError, decode
from clients.follow import EventFollower
from schemas.events import (
    EVENT_DECODER,
    Event,
    Metrics,
    PolicyPublished,
    Progress,
    Rejected,
    StateChanged,
)
from schemas.jobs import TERMINAL_STATUSES

if TYPE_CHECKING:
    from clients.sdk import Client

log = logging.getLogger(__name__)


class JobFailed(RuntimeError):
    """The job was rejected, failed or was cancelled; ``result`` says how."""

    def __init__(self, result: JobResult) -> None:
        super().__init__(f"job {result.tenant}/{result.job_id} {result.status}: {result.reason}")
        self.result = result


@dataclass
class JobResult:
    """How a job ended."""

    tenant: str
    job_id: str
    status: str
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    policy_version: int = 0


class Job:
    """A submitted job: its events and its outcome."""

    def __init__(self, client: Client, tenant: str, job_id: str) -> None:
        self.client = client
        self.tenant = tenant
        self.job_id = job_id

    async def events(
        self, idle_timeout: float | None = None, *, poll_s: float = 2.0
    ) -> AsyncIterator[Event]:
        """All of the job's events from the first, in order, until it ends (terminal state
        or rejection). ``idle_timeout`` bounds the wait for each next event. They are read
        from the master a page at a time, woken by the live events and otherwise every
        ``poll_s`` (:class:`EventFollower`), so a reconnect or a master restart neither
        skips nor repeats one."""
        follower = EventFollower(
            self.client.nc, self.client.read_events, self.tenant, self.job_id, poll_s
        )
        try:
            while True:
                stored = await follower.next(idle_timeout or 3600.0)
                try:
                    event = decode(EVENT_DECODER, stored.data)
                except DecodeError as exc:
                    # A kind of event this client does not know (a newer service's): the
                    # job goes on, and so does following it.
                    log.info("event %d of %s skipped: %s", stored.seq, self.job_id, exc)
                    continue
                yield event
                if isinstance(event, Rejected) or (
                    isinstance(event, StateChanged) and event.status in TERMINAL_STATUSES
                ):
                    return
        finally:
            await follower.close()

    async def wait(self, timeout: float | None = None) -> JobResult:
        """Wait for the end; return the result if it succeeded, else raise :class:`JobFailed`."""

        async def follow() -> JobResult:
            result = JobResult(self.tenant, self.job_id, "unknown")
            async for event in self.events():
                match event:
                    case Progress():
                        result.metrics = dict(event.metrics)
                    case Metrics():
                        result.metrics = dict(event.metrics)
                    case PolicyPublished():
                        result.policy_version = event.version
                    case Rejected():
                        result.status, result.reason = "rejected", event.reason
                    case StateChanged():
                        result.status, result.reason = event.status, event.reason
            record = await self.client.status(self.tenant, self.job_id)
            if record is not None:
                result.metrics = dict(record.metrics) or result.metrics
                result.policy_version = record.policy_version or result.policy_version
            return result

        result = await asyncio.wait_for(follow(), timeout)
        if result.status != "succeeded":
            raise JobFailed(result)
        return result

    async def cancel(self, reason: str = "") -> None:
        await self.client.cancel(self.tenant, self.job_id, reason)
