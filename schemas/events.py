"""Events a tenant can watch on ``nexus.event.<tenant>.<job>.<kind>`` (stream EVENTS).

One tagged union for the whole family; the tag equals the subject's ``<kind>`` token.
"""

from __future__ import annotations

import msgspec

from schemas.jobs import JobStatus


class Accepted(msgspec.Struct, frozen=True, tag="accepted"):
    """The master validated and recorded the job."""

    tenant: str
    job_id: str
    kind: str
    at: float


class Rejected(msgspec.Struct, frozen=True, tag="rejected"):
    """The job (or a message of it) was refused; ``reason`` names what was wrong."""

    tenant: str
    job_id: str
    reason: str
    at: float


class StateChanged(msgspec.Struct, frozen=True, tag="state"):
    """The job's status changed."""

    tenant: str
    job_id: str
    status: JobStatus
    at: float
    reason: str = ""


class Progress(msgspec.Struct, frozen=True, tag="progress"):
    """Training progress: ``step`` of ``total_steps`` with the latest metrics."""

    tenant: str
    job_id: str
    step: int
    total_steps: int
    metrics: dict[str, float]
    at: float


class PolicyPublished(msgspec.Struct, frozen=True, tag="policy"):
    """A new policy version was committed to the ``checkpoints`` store."""

    tenant: str
    job_id: str
    version: int
    object_name: str
    step: int
    at: float
    #: The job's last step is in this version (the trainer is done with the job).
    final: bool = False


class ErrorEvent(msgspec.Struct, frozen=True, tag="error"):
    """Something the tenant sent could not be processed (the rest of the job goes on unless
    ``fatal``)."""

    tenant: str
    job_id: str
    message: str
    retryable: bool
    fatal: bool
    at: float


class Metrics(msgspec.Struct, frozen=True, tag="metrics"):
    """Results of a finished unit of work: an RL iteration's rollouts (``iteration``) or an
    evaluation (``iteration`` = -1)."""

    tenant: str
    job_id: str
    iteration: int
    metrics: dict[str, float]
    at: float


class CallResult(msgspec.Struct, frozen=True, tag="call"):
    """The outcome of call ``call`` of a low-level session (``op``: the call's tag).

    ``metrics``: ``loss`` and ``samples`` of a forward(-backward); ``grad_norm``,
    ``learning_rate`` and ``step`` (updates so far) of an optim step. ``version``: the
    policy version a save committed (or a load restored). ``error``: why the call was not
    applied (the session goes on; the call still counts as done); ``retryable`` whether
    sending the same work again as a new call can help."""

    tenant: str
    job_id: str
    call: int
    op: str
    metrics: dict[str, float]
    at: float
    version: int = 0
    error: str = ""
    retryable: bool = False


Event = (
    Accepted
    | Rejected
    | StateChanged
    | Progress
    | PolicyPublished
    | ErrorEvent
    | Metrics
    | CallResult
)
EVENT_DECODER = msgspec.msgpack.Decoder(Event)


def event_kind(event: Event) -> str:
    """The subject token of an event (its tag)."""
    return str(type(event).__struct_config__.tag)
