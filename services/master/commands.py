"""Job command intake: what a message on ``nexus.job.<tenant>.<verb>`` must be before the
master acts on it, and which job a refused one is about (so its sender can be answered)."""

from __future__ import annotations

import msgspec
from nats.aio.msg import Msg

from bus.codec import DecodeError, decode
from bus.errors import PoisonError
from schemas import headers, subjects
from schemas.ids import InvalidIdError, validate_id
from schemas.jobs import JOB_COMMAND_DECODER, JobCommand
from schemas.limits import InputLimits
from services.master.limits import check_size

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
