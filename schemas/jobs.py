"""Messages on ``nexus.job.<tenant>.<verb>`` (stream JOBS) and the ``jobs`` KV record.

Decode with :data:`JOB_COMMAND_DECODER`; the tag is the verb, so a message whose tag does not
match its subject's verb is rejected by the master.
"""

from __future__ import annotations

from typing import Literal

import msgspec

#: ``queued``: accepted and waiting for its tenant's running jobs to leave room under its
#: limits (the record's ``reason`` says which).
JobStatus = Literal["accepted", "queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


class JobSubmit(msgspec.Struct, frozen=True, tag="submit"):
    """Submit a job. ``spec_json`` is the user's job spec document (JSON), validated by the
    master against the pydantic models of :mod:`schemas.specs`, so the tenant gets the exact
    field that was wrong back as a ``rejected`` event."""

    tenant: str
    job_id: str
    spec_json: bytes
    submitted_at: float


class JobCancel(msgspec.Struct, frozen=True, tag="cancel"):
    """Cancel a running job; its slot is freed and state becomes ``cancelled``."""

    tenant: str
    job_id: str
    reason: str = ""


class JobPause(msgspec.Struct, frozen=True, tag="pause"):
    """Pause a job (keeps its slot checkpointed)."""

    tenant: str
    job_id: str


class JobResume(msgspec.Struct, frozen=True, tag="resume"):
    """Resume a paused job."""

    tenant: str
    job_id: str


JobCommand = JobSubmit | JobCancel | JobPause | JobResume
JOB_COMMAND_DECODER = msgspec.msgpack.Decoder(JobCommand)


class JobRecord(msgspec.Struct, frozen=True):
    """Value of the ``jobs`` KV entry ``<tenant>.<job>``: the job's state machine."""

    tenant: str
    job_id: str
    kind: str
    status: JobStatus
    spec_json: bytes
    created_at: float
    updated_at: float
    #: Human-readable reason for failed/cancelled.
    reason: str = ""
    #: Final or latest metrics (name → value).
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    #: Latest committed policy version of this job (0 = none yet).
    policy_version: int = 0
    #: The pipeline job this job is a stage of ("" = submitted by the tenant).
    parent: str = ""


JOB_RECORD_DECODER = msgspec.msgpack.Decoder(JobRecord)


def job_key(tenant: str, job_id: str) -> str:
    """KV key of a job record."""
    return f"{tenant}.{job_id}"
