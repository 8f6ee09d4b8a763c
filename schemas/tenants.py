"""Tenants and their data: the ``tenants`` and ``datasets`` KV records.

Only service and operator identities read or write these buckets (the broker keeps tenants out
of every KV bucket); a tenant learns about its own datasets through the master's
``nexus.ctl.tenant.<tenant>.datasets`` request.
"""

from __future__ import annotations

from typing import Literal

import msgspec

IdentityRole = Literal["tenant", "service", "operator"]


PriorityClass = Literal["low", "normal", "high"]
#: A priority class's weight: a job's share on the trainer (DRR) and in inference batches is
#: its tenant's class weight times the job's own ``priority``.
PRIORITY_WEIGHTS: dict[str, int] = {"low": 1, "normal": 2, "high": 4}


class TenantLimits(msgspec.Struct, frozen=True):
    """What one tenant may hold at once and how it is served; set by the operator
    (``joynexus tenant add/set``). A job that would take the tenant past a holding limit
    waits (``queued``, with the reason) until the tenant's running jobs leave room; one
    that could never fit is rejected, naming the limit."""

    #: Top-level jobs running at once.
    max_concurrent_jobs: int = 4
    #: Bytes the tenant's object store bucket (datasets + exported policies) may hold; the
    #: broker refuses writes past it.
    max_storage_bytes: int = 1 << 30
    #: Slots on the trainers (SFT, RL and session jobs each hold one) at once.
    max_slots: int = 4
    #: Simulator sessions of the tenant's running RL and evaluation jobs at once (an RL
    #: job holds ``episodes_per_iteration`` x (``max_policy_lag`` + 1), an evaluation
    #: ``parallel_envs``).
    max_env_sessions: int = 32
    #: Samples of one SFT job in flight: streamed into TRAIN and not yet in a committed
    #: checkpoint (its stream's backpressure).
    max_inflight_samples: int = 1024
    #: Priority class: weight 1, 2 or 4 (:data:`PRIORITY_WEIGHTS`).
    priority: PriorityClass = "normal"
    #: The highest ``priority`` one of its jobs may ask for (a weight among its own jobs).
    max_job_priority: int = 4

    @property
    def weight(self) -> int:
        return PRIORITY_WEIGHTS[self.priority]


class TenantRecord(msgspec.Struct, frozen=True):
    """A registered tenant, key ``<tenant>`` in the ``tenants`` KV. When the bucket holds any
    record, the master accepts work only from registered, unrevoked tenants."""

    name: str
    #: The tenant's current NKey public key (``U...``); a rotation replaces it.
    public_key: str
    created_at: float
    limits: TenantLimits = TenantLimits()
    rotated_at: float = 0.0
    revoked: bool = False


DatasetSource = Literal["pushed", "registered"]


class DatasetRecord(msgspec.Struct, frozen=True):
    """A dataset in a tenant's namespace, key ``<tenant>.<dataset>`` in the ``datasets`` KV.

    ``pushed``: uploaded by the tenant into its bucket (one object per file under
    ``datasets/<dataset>/``, plus a manifest of their SHA-256 digests). ``registered``: a
    directory on the services' disks that the operator put in the tenant's namespace.
    """

    tenant: str
    dataset: str
    source: DatasetSource
    created_at: float
    #: ``registered``: the directory's path on the services' filesystem.
    path: str = ""
    #: ``pushed``: the bucket and object-name prefix of its files.
    bucket: str = ""
    prefix: str = ""
    files: int = 0
    bytes: int = 0
    #: SHA-256 of the manifest (pushed) — a cache of it is valid while this matches.
    digest: str = ""


def dataset_key(tenant: str, dataset: str) -> str:
    """Key of a dataset record: ``<tenant>.<dataset>``."""
    return f"{tenant}.{dataset}"


class ManifestFile(msgspec.Struct, frozen=True):
    """One file of a pushed dataset: its path relative to the dataset's root (POSIX)."""

    path: str
    size: int
    sha256: str


class DatasetManifest(msgspec.Struct, frozen=True):
    """What a complete push contains; written after every file."""

    dataset: str
    files: list[ManifestFile]
    created_at: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


TENANT_RECORD_DECODER = msgspec.msgpack.Decoder(TenantRecord)
DATASET_RECORD_DECODER = msgspec.msgpack.Decoder(DatasetRecord)
