"""The master's state as an operator (and the replay test) reads it: the job table and what
the master rebuilds in memory from it at start (queued jobs, open sessions' leases).

A restarted master answers with the same bytes as the one it replaced, when nothing moved in
between: its state is the ``jobs`` KV and what follows from it, never a clock reading taken
at start.
"""

from __future__ import annotations

import msgspec

from schemas import subjects
from schemas.jobs import JobRecord

#: Core NATS request-reply, empty request, :class:`MasterState` reply (operator/service only).
MASTER_STATE_SUBJECT = f"{subjects.PREFIX}.ctl.master.state"


class QueuedJob(msgspec.Struct, frozen=True):
    """A job waiting for its tenant's limits (:mod:`services.master.admission`)."""

    tenant: str
    job_id: str
    #: When it was accepted (the record's ``created_at``): the queue is oldest first.
    since: float


class LeasedSession(msgspec.Struct, frozen=True):
    """An open low-level session whose lease the master keeps."""

    tenant: str
    job_id: str
    #: Its spec's lease: a session silent this long is cancelled.
    lease_s: float


class MasterState(msgspec.Struct, frozen=True, tag="master_state"):
    """Everything a master decides from, in a fixed order (tenant, then job)."""

    #: Every record of the ``jobs`` KV.
    jobs: list[JobRecord]
    #: Jobs waiting for room, as the admissions loop holds them.
    queued: list[QueuedJob]
    #: Sessions whose lease runs (when each was last renewed is left out: a restart gives
    #: every open session a whole lease from then, on purpose).
    sessions: list[LeasedSession]


MASTER_STATE_DECODER = msgspec.msgpack.Decoder(MasterState)
