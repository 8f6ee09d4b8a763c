"""``export``: a committed policy version of one of the tenant's jobs, copied into its bucket
as ``policies/<job>/v<n>`` for the tenant to read back in parts (``export-read``,
:meth:`services.master.transfer.Transfer.read_export`); ``export-rm``
(:meth:`services.master.removal.Removal.export`) deletes such copies."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus.checkpoints import CheckpointError, committed_object, digest, get_checkpoint
from bus.datasets import policy_object
from bus.records import get_policy
from schemas import subjects
from schemas.ids import validate_id
from schemas.tenantctl import CtlError, ExportPolicy, PolicyExported, TenantReply
from services.master.transfer import Transfer


async def export_policy(
    js: JetStreamContext, policies: KeyValue, transfer: Transfer, request: ExportPolicy
) -> TenantReply:
    """Copy a committed version (``request.version``, 0: the latest) of the tenant's own job
    into its bucket."""
    tenant, job_id = request.tenant, validate_id(request.job_id, "job id")
    if request.version < 0:
        return CtlError("invalid", f"version: {request.version} is negative")
    policy, _ = await get_policy(policies, tenant, job_id)
    if policy is None:
        return CtlError("not_found", f"job {job_id!r} of tenant {tenant} has no committed policy")
    version = request.version or policy.version
    store = await js.object_store(subjects.OBJ_CHECKPOINTS)
    try:
        if version == policy.version:
            data = await get_checkpoint(store, policy.object_name, policy.sha256)
        elif version > policy.version:
            return CtlError(
                "not_found",
                f"version: {version} is newer than job {job_id!r}'s latest committed "
                f"version {policy.version}",
            )
        else:
            data = await _older_version(policies, store, tenant, job_id, version)
    except CheckpointError as exc:
        return CtlError("not_found", f"version {version} of job {job_id!r}: {exc}")
    bucket = await transfer.store(tenant)
    name = policy_object(job_id, version)
    await transfer.put_object(bucket, tenant, name, name, data)
    return PolicyExported(
        subjects.tenant_bucket(tenant), name, job_id, version, digest(data), len(data)
    )


async def _older_version(
    policies: KeyValue, store: ObjectStore, tenant: str, job_id: str, version: int
) -> bytes:
    """A version older than the latest: the object its commit recorded (an object of the
    same version a failed commit left behind is never taken for it)."""
    name, sha256 = await committed_object(policies, store, tenant, job_id, version)
    return await get_checkpoint(store, name, sha256)
