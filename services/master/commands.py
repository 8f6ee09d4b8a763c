"""Job command intake: what a message on ``nexus.job.<tenant>.<verb>`` must be before the
master acts on it, and which job a refused one is about (so its sender is answered)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgspec
from nats.aio.msg import Msg

from bus.codec import DecodeError, decode
from bus.errors import PoisonError
from bus.publish import publish_event
from schemas import headers, subjects
from schemas.events import Rejected
from schemas.ids import InvalidIdError, validate_id
from schemas.jobs import JOB_COMMAND_DECODER, JobCommand, JobSubmit
from schemas.limits import InputLimits
from services.master.limits import check_size

if TYPE_CHECKING:
    from services.master.service import Master

log = logging.getLogger(__name__)

#: Header the SDK sets so that even a command whose payload does not decode at all can be
#: answered on its job's events. Optional: a command whose envelope decodes is answered
#: from the job id it names (:meth:`services.master.service.Master.on_dead`).
JOB_ID_HEADER = headers.JOB_ID


class _CommandEnvelope(msgspec.Struct):
    """The identity fields every job command has, read without the rest of it (a submit
    whose spec or other fields are bad still names its tenant and job)."""

    tenant: str = ""
    job_id: str = ""


_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_CommandEnvelope)


def parse_command(msg: Msg, limits: InputLimits) -> JobCommand:
    """The command ``msg`` carries, checked against its subject (verb and tenant) and the
    operator's size bound; :class:`PoisonError` saying what is wrong otherwise."""
    try:
        subject_tenant, verb = subjects.parse_job(msg.subject)
    except subjects.SubjectError as exc:
        raise PoisonError(str(exc)) from exc
    check_size("job command", len(msg.data), "max_message_bytes", limits.max_message_bytes)
    try:
        command = decode(JOB_COMMAND_DECODER, msg.data)
    except DecodeError as exc:
        raise PoisonError(f"malformed job command on {msg.subject}: {exc}") from exc
    tag = type(command).__struct_config__.tag
    if tag != verb:
        raise PoisonError(f"a {tag!r} command was sent on the {verb!r} subject")
    if command.tenant != subject_tenant:
        raise PoisonError(
            f"tenant: command for tenant {command.tenant!r} sent on tenant "
            f"{subject_tenant!r}'s subject"
        )
    try:
        validate_id(command.job_id, "job id")
    except InvalidIdError as exc:
        raise PoisonError(str(exc)) from exc
    return command


def job_id_of(msg: Msg) -> str:
    """The job a dead command is about: the one its envelope names, else the header's."""
    try:
        named = _ENVELOPE_DECODER.decode(msg.data).job_id
    except msgspec.DecodeError:
        named = ""
    try:
        return validate_id(named, "job id")
    except InvalidIdError:
        return (msg.headers or {}).get(JOB_ID_HEADER, "")


async def answer_refused(master: Master, msg: Msg, reason: str) -> None:
    """Tell the sender why its command was refused, on its job's ``rejected`` subject.

    The sender is the subject's tenant (the broker lets a tenant publish only on its own
    job subjects), never the tenant a message claims to be from. The job is the one the
    command names: every command whose envelope decodes is answered, whatever else is
    wrong with it and whatever headers it has. Only a payload that does not decode at
    all, sent without :data:`JOB_ID_HEADER`, has its dead letter as its only record.
    """
    tenant = subjects.tenant_of(msg.subject) or ""
    job_id = job_id_of(msg)
    try:
        validate_id(tenant, "tenant")
        validate_id(job_id, "job id")
    except InvalidIdError:
        log.warning("rejected unattributable job command on %s: %s", msg.subject, reason)
        return
    if await _anothers_job(master, tenant, job_id, msg.data):
        # Its events are that job's: a ``rejected`` among them would end its followers.
        log.warning("refused a submit under %s/%s, another job's id: %s", tenant, job_id, reason)
        return
    rejected = Rejected(tenant, job_id, reason, time.time())
    await publish_event(master.js, rejected, msg.metadata.sequence.stream)
    await _fail_unstarted(master, tenant, job_id, msg.data, reason)


async def _anothers_job(master: Master, tenant: str, job_id: str, data: bytes) -> bool:
    """Whether ``data`` is a submit whose job id a recorded job with another spec holds."""
    try:
        command = decode(JOB_COMMAND_DECODER, data)
    except DecodeError:
        return False
    if not isinstance(command, JobSubmit):
        return False
    found = await master.record(tenant, job_id)
    return found is not None and found[0].spec_json != command.spec_json


async def _fail_unstarted(
    master: Master, tenant: str, job_id: str, data: bytes, reason: str
) -> None:
    """A submit that recorded its job and then gave up before starting it (a redelivered
    submit fails the same way each time) leaves a job ``accepted`` that nothing will
    start, holding a place among its tenant's running jobs: it fails, with the reason."""
    try:
        command = decode(JOB_COMMAND_DECODER, data)
    except DecodeError:
        return
    if not isinstance(command, JobSubmit):
        return
    found = await master.record(tenant, job_id)
    if found is None:
        return
    record = found[0]
    # Another submit's job under the same id (refused for that) is not this one's.
    if record.status == "accepted" and record.spec_json == command.spec_json:
        await master.transition(tenant, job_id, "failed", reason=f"not started: {reason}")
