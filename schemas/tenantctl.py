"""Everything a tenant does on the bus, and the replies (core NATS request-reply).

A tenant's identity has no JetStream at all: the server sends JetStream's own answers (publish
acks, API responses, pull deliveries) to whatever reply subject a request names, without
checking it against the requester's permissions, so any JetStream access would let a tenant
write into another's KV entries or streams. Instead it submits and cancels jobs, reads its
events, uploads datasets and downloads policies through these requests, which the master
answers only on the tenant's own inbox (:func:`bus.auth.reply_allowed`).

A tenant sends a :data:`TenantRequest` on ``nexus.ctl.tenant.<tenant>.<op>``
(:func:`schemas.subjects.tenant_ctl`); the request's tag is the op and its ``tenant`` must be
the subject's tenant token. The master answers every request, well-formed or not, with one
:data:`TenantReply`: the op's answer or a :class:`CtlError` naming what was wrong.
``nexus.ctl.backbones`` (:data:`schemas.subjects.BACKBONES_QUERY`) is answered with a
:data:`BackbonesReply`. A tenant never reads a KV bucket or another object store itself: the
broker denies it, and these requests are how it learns what it may know.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.infer import ActReply
from schemas.jobs import JobRecord
from schemas.model import Observation
from schemas.placement import PlacementRecord
from schemas.tenants import DatasetRecord, ManifestFile
from schemas.train import SessionCall

#: Why a request got no answer; ``retryable`` tells whether asking again can help.
CtlErrorCode = Literal[
    "malformed",  # the payload does not decode, or its tag does not match the subject's op
    "tenant_mismatch",  # the request claims another tenant than its subject's
    "unknown_tenant",  # registered tenants exist and this one is not (or is revoked)
    "not_found",  # no such job, dataset or policy version of this tenant
    "invalid",  # a dataset or value that fails its checks (the message names the file/field)
    "unavailable",  # the master could not finish now (the broker is away, a store is missing)
    "closed",  # the session is not running (never opened, closed, or its lease ran out)
]


class GetJob(msgspec.Struct, frozen=True, tag="job"):
    """The record of one of the tenant's jobs."""

    tenant: str
    job_id: str


class ListJobs(msgspec.Struct, frozen=True, tag="jobs"):
    """The tenant's job records in job id order, as many as fit one reply, after the job id
    ``after`` (the reply's ``next_after`` asks for the rest)."""

    tenant: str
    #: The job id the previous page ended with ("": from the first).
    after: str = ""


class ListDatasets(msgspec.Struct, frozen=True, tag="datasets"):
    """Every dataset in the tenant's namespace."""

    tenant: str


class SubmitJob(msgspec.Struct, frozen=True, tag="submit"):
    """Submit a job: the master queues it on ``JOBS`` (idempotent per ``job_id``) and answers
    :class:`Queued`; the spec is validated when the master takes it from the queue, and a bad
    one is answered by a ``rejected`` event naming the field (read with :class:`ReadEvents`).
    ``spec_json`` is the job spec document (JSON)."""

    tenant: str
    job_id: str
    spec_json: bytes


class CancelJob(msgspec.Struct, frozen=True, tag="cancel"):
    """Cancel one of the tenant's jobs (queued on ``JOBS`` like a submit)."""

    tenant: str
    job_id: str
    reason: str = ""


class ReadEvents(msgspec.Struct, frozen=True, tag="events"):
    """The job's events after stream sequence ``after_seq`` (0: from the first), oldest
    first, at most ``limit`` of them (the reply also stays under the broker's payload limit).
    An empty page means nothing newer yet: the tenant may subscribe to
    ``nexus.event.<tenant>.<job>.>`` to learn when to ask again."""

    tenant: str
    job_id: str
    after_seq: int = 0
    limit: int = 256


class PlanDataset(msgspec.Struct, frozen=True, tag="dataset-plan"):
    """Start (or resume) a push of dataset ``dataset`` with these ``files``: the master drops
    the dataset's old manifest (a half-replaced dataset is never complete) and answers
    :class:`DatasetPlan` with the files it still needs (missing, or another digest)."""

    tenant: str
    dataset: str
    files: list[ManifestFile]


class PutDatasetPart(msgspec.Struct, frozen=True, tag="dataset-part"):
    """Part ``index`` (0-based) of ``parts`` of one file of a push; parts are at most
    :data:`PART_BYTES`. When the last part arrives the master joins the parts, checks the
    file's ``size`` and ``sha256`` and stores it (answering :class:`PartStored` with
    ``complete``); a file that does not match is refused naming it."""

    tenant: str
    dataset: str
    path: str
    index: int
    parts: int
    size: int
    sha256: str
    data: bytes


class AddDataset(msgspec.Struct, frozen=True, tag="dataset-add"):
    """Finish a push: the master checks that every file of ``files`` is stored with its
    digest, writes the manifest, checks the files as a dataset and records it in the
    tenant's namespace. Without ``files``, the manifest already in the tenant's bucket (an
    operator's upload) is used."""

    tenant: str
    dataset: str
    files: list[ManifestFile] | None = None


class RemoveDataset(msgspec.Struct, frozen=True, tag="dataset-rm"):
    """Remove a dataset from the tenant's namespace: its record and, for a pushed one, its
    files in the tenant's bucket (what a push left without a ``dataset-add`` goes too).
    Refused while a job of the tenant that has not ended names it. A registered dataset's
    directory is the operator's: only its name leaves the namespace."""

    tenant: str
    dataset: str


class RemoveJob(msgspec.Struct, frozen=True, tag="job-rm"):
    """Remove one of the tenant's jobs that has ended, with everything kept of it: its
    policy versions (checkpoints, a session's saved states), their exported copies in the
    tenant's bucket, its events and its record; a pipeline's stages too. Refused while it
    (or a stage) has not ended, or while a job that has not ended starts from it
    (``init_from``) or evaluates it (``policy_job``). Its id is not given to a new job (a
    submit under it is refused): a service may still hold the removed job's state."""

    tenant: str
    job_id: str


class ExportPolicy(msgspec.Struct, frozen=True, tag="export"):
    """Copy a committed policy version of one of the tenant's jobs into its bucket
    (``policies/<job>/v<version>``) for download. ``version`` 0 = the latest."""

    tenant: str
    job_id: str
    version: int = 0


class RemoveExport(msgspec.Struct, frozen=True, tag="export-rm"):
    """Delete exported copies of one of the tenant's jobs from its bucket (its storage
    given back): version ``version``'s, or with 0 every one of the job's. The job's committed
    versions stay; export one again to download it."""

    tenant: str
    job_id: str
    version: int = 0


class ReadExport(msgspec.Struct, frozen=True, tag="export-read"):
    """``length`` bytes (at most :data:`PART_BYTES`) from ``offset`` of a policy exported
    with :class:`ExportPolicy` (its ``object_name``)."""

    tenant: str
    object_name: str
    offset: int
    length: int = 0


class CallSession(msgspec.Struct, frozen=True, tag="call"):
    """Queue call ``call.call`` of the tenant's low-level session ``job_id`` (a running job
    of kind ``session``) on its Training Queue. Answered :class:`Queued` (a repeat of the
    same call number is ``duplicate``); the call's outcome is a ``call`` event
    (:class:`schemas.events.CallResult`) on the session's events. Also renews the lease."""

    tenant: str
    job_id: str
    call: SessionCall


class RenewLease(msgspec.Struct, frozen=True, tag="lease"):
    """Keep the tenant's session ``job_id`` open (a client with no call to send sends this
    within every ``lease_s``); answered :class:`Leased`."""

    tenant: str
    job_id: str


class SamplePolicy(msgspec.Struct, frozen=True, tag="act"):
    """Actions for ``observations`` from a committed version of one of the tenant's policies
    (a job's or a session's; ``version`` 0 = the latest), served by an inferencer with the
    same grouped forwards as rollouts. ``seed`` >= 0 makes the samples reproducible.
    Answered :class:`Sampled`."""

    tenant: str
    job_id: str
    observations: list[Observation]
    version: int = 0
    deterministic: bool = False
    seed: int = -1
    timeout_s: float = 10.0


#: The largest piece of a file in one request or reply (the broker's payload limit is 1 MiB).
PART_BYTES = 256 * 1024

TenantRequest = (
    GetJob
    | ListJobs
    | ListDatasets
    | AddDataset
    | RemoveDataset
    | RemoveJob
    | ExportPolicy
    | RemoveExport
    | SubmitJob
    | CancelJob
    | ReadEvents
    | PlanDataset
    | PutDatasetPart
    | ReadExport
    | CallSession
    | RenewLease
    | SamplePolicy
)
TENANT_REQUEST_DECODER = msgspec.msgpack.Decoder(TenantRequest)


class CtlError(msgspec.Struct, frozen=True, tag="error"):
    """A request that got no answer: ``code`` says which kind of problem, ``message`` names
    the field, file or limit; ``retryable`` whether asking again may succeed."""

    code: CtlErrorCode
    message: str
    retryable: bool = False


class JobReply(msgspec.Struct, frozen=True, tag="job"):
    record: JobRecord


class JobsReply(msgspec.Struct, frozen=True, tag="jobs"):
    records: list[JobRecord]
    #: The ``after`` of the next page; "" when these are the last records.
    next_after: str = ""


class DatasetsReply(msgspec.Struct, frozen=True, tag="datasets"):
    records: list[DatasetRecord]


class DatasetAdded(msgspec.Struct, frozen=True, tag="dataset-add"):
    record: DatasetRecord


class DatasetRemoved(msgspec.Struct, frozen=True, tag="dataset-rm"):
    """What a ``dataset-rm`` removed: the record (``recorded``: there was one) and ``files``
    objects of ``bytes`` in all from the tenant's bucket (its storage given back)."""

    dataset: str
    recorded: bool
    files: int
    bytes: int


class JobRemoved(msgspec.Struct, frozen=True, tag="job-rm"):
    """What a ``job-rm`` removed: the records of ``jobs`` (the job, then its stages),
    ``objects`` checkpoints and exported copies of ``bytes`` in all, and ``events``."""

    job_id: str
    jobs: list[str]
    objects: int
    bytes: int
    events: int


class PolicyExported(msgspec.Struct, frozen=True, tag="export"):
    """Where the exported policy is: object ``object_name`` of ``bucket`` (the tenant's),
    ``size`` bytes with SHA-256 ``sha256`` (the checkpoint's own digest)."""

    bucket: str
    object_name: str
    job_id: str
    version: int
    sha256: str
    size: int


class ExportRemoved(msgspec.Struct, frozen=True, tag="export-rm"):
    """What an ``export-rm`` deleted: the exported copies of ``versions`` of ``job_id``,
    ``bytes`` in all."""

    job_id: str
    versions: list[int]
    bytes: int


class Queued(msgspec.Struct, frozen=True, tag="queued"):
    """A submit or cancel is on ``JOBS`` at ``stream_seq`` (a repeat of the same command is
    the same message: ``duplicate``)."""

    job_id: str
    stream_seq: int
    duplicate: bool = False


class StoredEvent(msgspec.Struct, frozen=True):
    """One event as stored: its ``EVENTS`` stream sequence, subject and msgpack body (decode
    with :data:`schemas.events.EVENT_DECODER`)."""

    seq: int
    subject: str
    data: bytes


class EventsPage(msgspec.Struct, frozen=True, tag="events"):
    """Events after the request's ``after_seq``, oldest first; ``last_seq`` is the sequence to
    ask after next (the request's ``after_seq`` when the page is empty)."""

    events: list[StoredEvent]
    last_seq: int


class DatasetPlan(msgspec.Struct, frozen=True, tag="dataset-plan"):
    """The files of a push the master still needs, by path."""

    needed: list[str]


class PartStored(msgspec.Struct, frozen=True, tag="dataset-part"):
    """A part was stored; ``complete`` when it was the file's last and the file is stored."""

    path: str
    index: int
    complete: bool


class ExportBytes(msgspec.Struct, frozen=True, tag="export-read"):
    """A piece of an exported policy; ``size`` is the whole object's."""

    offset: int
    data: bytes
    size: int


class Leased(msgspec.Struct, frozen=True, tag="lease"):
    """The session stays open until ``lease_s`` after this reply without a call or renewal."""

    job_id: str
    lease_s: float


class Sampled(msgspec.Struct, frozen=True, tag="act"):
    """The inferencer's answer (``reply.error`` is never set: a refusal is a CtlError)."""

    reply: ActReply


TenantReply = (
    JobReply
    | JobsReply
    | DatasetsReply
    | DatasetAdded
    | DatasetRemoved
    | JobRemoved
    | PolicyExported
    | ExportRemoved
    | Queued
    | EventsPage
    | DatasetPlan
    | PartStored
    | ExportBytes
    | Leased
    | Sampled
    | CtlError
)
TENANT_REPLY_DECODER = msgspec.msgpack.Decoder(TenantReply)


class BackbonesQuery(msgspec.Struct, frozen=True, tag="backbones"):
    """What backbones are served now (an empty payload asks the same)."""


class Backbones(msgspec.Struct, frozen=True, tag="backbones"):
    """The live placements: one record per heartbeating trainer or inferencer instance."""

    placements: list[PlacementRecord]


BackbonesReply = Backbones | CtlError
BACKBONES_QUERY_DECODER = msgspec.msgpack.Decoder(BackbonesQuery)
BACKBONES_REPLY_DECODER = msgspec.msgpack.Decoder(BackbonesReply)
