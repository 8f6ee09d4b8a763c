"""Requests a tenant makes about its own things, and their replies (core NATS request-reply).

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

from schemas.jobs import JobRecord
from schemas.placement import PlacementRecord
from schemas.tenants import DatasetRecord

#: Why a request got no answer; ``retryable`` tells whether asking again can help.
CtlErrorCode = Literal[
    "malformed",  # the payload does not decode, or its tag does not match the subject's op
    "tenant_mismatch",  # the request claims another tenant than its subject's
    "unknown_tenant",  # registered tenants exist and this one is not (or is revoked)
    "not_found",  # no such job, dataset or policy version of this tenant
    "invalid",  # a dataset or value that fails its checks (the message names the file/field)
    "unavailable",  # the master could not finish now (the broker is away, a store is missing)
]


class GetJob(msgspec.Struct, frozen=True, tag="job"):
    """The record of one of the tenant's jobs."""

    tenant: str
    job_id: str


class ListJobs(msgspec.Struct, frozen=True, tag="jobs"):
    """Every job record of the tenant, oldest first."""

    tenant: str


class ListDatasets(msgspec.Struct, frozen=True, tag="datasets"):
    """Every dataset in the tenant's namespace."""

    tenant: str


class AddDataset(msgspec.Struct, frozen=True, tag="dataset-add"):
    """Put a pushed dataset (``datasets/<dataset>/`` in the tenant's bucket, manifest written
    last) into the tenant's namespace: the master verifies every file against the manifest's
    digests and checks the dataset before it writes the record."""

    tenant: str
    dataset: str


class ExportPolicy(msgspec.Struct, frozen=True, tag="export"):
    """Copy a committed policy version of one of the tenant's jobs into its bucket
    (``policies/<job>/v<version>``) for download. ``version`` 0 = the latest."""

    tenant: str
    job_id: str
    version: int = 0


TenantRequest = GetJob | ListJobs | ListDatasets | AddDataset | ExportPolicy
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


class DatasetsReply(msgspec.Struct, frozen=True, tag="datasets"):
    records: list[DatasetRecord]


class DatasetAdded(msgspec.Struct, frozen=True, tag="dataset-add"):
    record: DatasetRecord


class PolicyExported(msgspec.Struct, frozen=True, tag="export"):
    """Where the exported policy is: object ``object_name`` of ``bucket`` (the tenant's),
    ``size`` bytes with SHA-256 ``sha256`` (the checkpoint's own digest)."""

    bucket: str
    object_name: str
    job_id: str
    version: int
    sha256: str
    size: int


TenantReply = JobReply | JobsReply | DatasetsReply | DatasetAdded | PolicyExported | CtlError
TENANT_REPLY_DECODER = msgspec.msgpack.Decoder(TenantReply)


class BackbonesQuery(msgspec.Struct, frozen=True, tag="backbones"):
    """What backbones are served now (an empty payload asks the same)."""


class Backbones(msgspec.Struct, frozen=True, tag="backbones"):
    """The live placements: one record per heartbeating trainer or inferencer instance."""

    placements: list[PlacementRecord]


BackbonesReply = Backbones | CtlError
BACKBONES_QUERY_DECODER = msgspec.msgpack.Decoder(BackbonesQuery)
BACKBONES_REPLY_DECODER = msgspec.msgpack.Decoder(BackbonesReply)
