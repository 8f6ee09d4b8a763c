"""A tenant's job commands and event reads, done for it by the master.

A tenant's identity has no JetStream (:mod:`schemas.tenantctl` says why), so it cannot publish
onto ``JOBS`` nor read ``EVENTS`` itself. The master queues its submits and cancels on
``JOBS`` exactly as a service publish would (same subject, same ``Nats-Msg-Id``, so a repeated
request is the same command) and reads its job's events from ``EVENTS`` by subject, a page at
a time. Which tenant is asking is the request subject's token (the broker lets a tenant
publish only under its own), already checked against the request by
:meth:`services.master.queries.Queries.answer`.
"""

from __future__ import annotations

import time

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.codec import DecodeError, decode
from bus.publish import msg_id, publish
from bus.records import get_job, job_removed
from schemas import headers, subjects
from schemas.events import EVENT_DECODER, Rejected
from schemas.ids import validate_id
from schemas.jobs import JobCancel, JobSubmit
from schemas.tenantctl import (
    CancelJob,
    CtlError,
    EventsPage,
    Queued,
    ReadEvents,
    StoredEvent,
    SubmitJob,
    TenantReply,
)

#: A page of events stays this far under the broker's 1 MiB payload limit.
PAGE_BYTES = 512 * 1024
MAX_PAGE_EVENTS = 1024
#: Stream sequences a read may start after (JetStream's are 64-bit; it refuses the next past).
MAX_SEQ = 2**63


#: Rejections of one job id looked through for the one that answered a command.
MAX_REJECTIONS_READ = 64


class TenantJobs:
    """Queues tenants' job commands and pages through their events."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        #: A page's bytes at most (lowered to half the server's max_payload at subscribe).
        self.page_bytes = PAGE_BYTES

    async def command(self, request: SubmitJob | CancelJob) -> TenantReply:
        """Put the command on ``JOBS``; the master's consumer applies it like any other (a bad
        spec is answered there, by a ``rejected`` event naming the field). A submit under the
        id of a recorded job with another spec is refused at once (the same spec again is the
        same submit, answered as queued)."""
        tenant, job_id = request.tenant, validate_id(request.job_id, "job id")
        jobs = await self.js.key_value(subjects.KV_JOBS)
        if isinstance(request, SubmitJob):
            existing, _ = await get_job(jobs, tenant, job_id)
            if existing is None and await job_removed(jobs, tenant, job_id):
                return CtlError(
                    "invalid",
                    f"job id {job_id!r} was a job of tenant {tenant} that was removed: "
                    "submit under a new id",
                )
            if existing is not None and existing.spec_json != request.spec_json:
                # Refused here, to its sender: refused on JOBS, it would be answered on the
                # job's own event subject, where the live job's followers would read it.
                return CtlError(
                    "invalid",
                    f"job id {job_id!r} is already used by another job of tenant {tenant} "
                    f"({existing.kind}, {existing.status}): submit under a new id",
                )
            verb = "submit"
            command: JobSubmit | JobCancel = JobSubmit(
                tenant, job_id, request.spec_json, time.time()
            )
        else:
            if await job_removed(jobs, tenant, job_id):
                return CtlError("not_found", f"job {job_id!r} of tenant {tenant} was removed")
            verb = "cancel"
            command = JobCancel(tenant, job_id, request.reason)
        ack = await publish(
            self.js,
            subjects.job(tenant, verb),
            command,
            message_id=msg_id(verb, tenant, job_id),
            headers={headers.JOB_ID: job_id},
        )
        if ack.duplicate and verb == "submit" and existing is None:
            # Dropped as the first submit under this id, which left no record: still
            # queued, or rejected (a resubmit after the fix would never reach the master).
            rejected = await self._rejected(tenant, job_id, ack.seq)
            if rejected is not None:
                return CtlError(
                    "invalid",
                    f"job id {job_id!r} was rejected: {rejected.reason}; submit under a new id",
                )
        return Queued(job_id, ack.seq, bool(ack.duplicate))

    async def _rejected(self, tenant: str, job_id: str, command_seq: int) -> Rejected | None:
        """The ``rejected`` event that answered the command stored at ``command_seq`` on
        ``JOBS`` (its msg id names that sequence), if there is one: not an older rejection
        of another command under the same job id."""
        subject = subjects.event(tenant, job_id, "rejected")
        wanted = msg_id("ev", tenant, job_id, "rejected", command_seq)
        seq = 0
        for _ in range(MAX_REJECTIONS_READ):
            try:
                stored = await self.js.get_msg(
                    subjects.STREAM_EVENTS, seq=seq + 1, subject=subject, next=True
                )
            except NotFoundError:
                return None
            seq = stored.seq or seq + 1
            if (stored.headers or {}).get(headers.MSG_ID) != wanted:
                continue
            try:
                event = decode(EVENT_DECODER, stored.data or b"")
            except DecodeError:
                return None
            return event if isinstance(event, Rejected) else None
        return None

    async def events(self, request: ReadEvents) -> TenantReply:
        """The job's events after ``after_seq``, oldest first, as many as fit one reply."""
        job_id = validate_id(request.job_id, "job id")
        if not 0 <= request.after_seq < MAX_SEQ:
            # Past it JetStream refuses the read, which would read as the bus not answering.
            return CtlError("invalid", f"after_seq: {request.after_seq} is not in 0..{MAX_SEQ - 1}")
        if not 1 <= request.limit <= MAX_PAGE_EVENTS:
            return CtlError("invalid", f"limit: {request.limit} is not in 1..{MAX_PAGE_EVENTS}")
        filter_subject = subjects.events_of_job(request.tenant, job_id)
        page: list[StoredEvent] = []
        size, seq = 0, request.after_seq
        while len(page) < request.limit:
            try:
                raw = await self.js.get_msg(
                    subjects.STREAM_EVENTS, seq=seq + 1, subject=filter_subject, next=True
                )
            except NotFoundError:
                break  # nothing newer
            data = raw.data or b""
            if page and size + len(data) > self.page_bytes:
                break
            seq = raw.seq or seq + 1
            page.append(StoredEvent(seq, raw.subject or "", data))
            size += len(data) + len(raw.subject or "")
        return EventsPage(page, seq)
