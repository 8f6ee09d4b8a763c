"""What the trainer tells tenants on ``EVENTS``: progress, policy versions, and why a message
of theirs was dead-lettered. Every event's ``Nats-Msg-Id`` comes from what it reports (a step,
a version, a dead letter's stream sequence), so a retried publish is a no-op."""

from __future__ import annotations

import time

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.codec import DecodeError, decode
from bus.publish import msg_id, publish
from schemas import headers, subjects
from schemas.events import EVENT_DECODER, ErrorEvent, Event, PolicyPublished, event_kind
from schemas.ids import InvalidIdError, validate_id
from schemas.train import TRAIN_DECODER
from services.trainer.jobs import JobError


async def announced_version(js: JetStreamContext, tenant: str, job_id: str) -> int:
    """The version the job's last stored ``policy`` event names (0: none is stored)."""
    subject = subjects.event(tenant, job_id, "policy")
    try:
        stored = await js.get_msg(subjects.STREAM_EVENTS, subject=subject)
        event = decode(EVENT_DECODER, stored.data or b"")
    except (NotFoundError, DecodeError):
        return 0
    return event.version if isinstance(event, PolicyPublished) else 0


class Announcer:
    """Publishes the trainer's events for tenants' jobs."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js

    async def emit(self, event: Event, step_id: int | str | None = None) -> None:
        """Publish ``event``; ``step_id`` identifies it unless it is a policy version."""
        kind = event_kind(event)
        ident = event.version if isinstance(event, PolicyPublished) else step_id
        assert ident is not None, f"{kind} event needs an identity"
        await publish(
            self.js,
            subjects.event(event.tenant, event.job_id, kind),
            event,
            message_id=msg_id("ev", event.tenant, event.job_id, kind, ident),
        )

    async def tell_tenant(self, msg: Msg, reason: str, error: BaseException) -> None:
        """A dead-lettered message's job hears why (fatal errors fail the job). Used as the
        tenants' durables' ``on_dead`` hook."""
        tenant = subjects.tenant_of(msg.subject) or ""
        if isinstance(error, JobError):
            job_id, fatal = error.job_id, error.fatal
        else:
            try:
                job_id, fatal = decode(TRAIN_DECODER, msg.data).job_id, True
            except DecodeError:
                # Every service that publishes on TRAIN names the job in a header too, so a
                # message another version of it wrote fails its job instead of leaving it
                # waiting for that message; the subject's tenant is the addressee.
                job_id, fatal = (msg.headers or {}).get(headers.JOB_ID, ""), True
                try:
                    validate_id(job_id, "job id")
                except InvalidIdError:
                    return  # nothing to address: the dead letter is the record
        event = ErrorEvent(tenant, job_id, reason, False, fatal, time.time())
        await self.emit(event, step_id=f"dead-{msg.metadata.sequence.stream}")
