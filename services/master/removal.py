"""What a tenant may remove, with what is stored of it: a dataset of its namespace
(``dataset-rm``), a job that has ended (``job-rm``) and exported copies of a job's policy
versions (``export-rm``). Each is refused, naming the jobs,
while a job of the tenant that has not ended needs it; the checks read the job records, so
a job accepted while a removal runs is not seen (it fails when it reads what is gone,
naming it).

A removal deletes the record last where a retry needs it to find the rest: a dataset's
record goes first (no new job can name it) and its manifest before its files (nothing can
materialise it half deleted); a job's checkpoints, exported copies, events and policy record
go before its job record, so a removal cut short is finished by asking again. A removed
job's record is purged, leaving the key's purge marker: its id is never given to a new job
(a trainer or inferencer may still hold the old job's state under it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from bus.datasets import (
    MANIFEST,
    DatasetStoreError,
    delete_dataset,
    policy_object,
    prefix_of,
    tenant_store,
)
from bus.kv import Removed, delete_objects, delete_under, kv_keys, objects_under
from bus.records import get_job, get_policy
from schemas import subjects
from schemas.ids import validate_id
from schemas.jobs import TERMINAL_STATUSES, JobRecord, job_key
from schemas.tenantctl import (
    CtlError,
    DatasetRemoved,
    ExportRemoved,
    JobRemoved,
    RemoveDataset,
    RemoveExport,
    RemoveJob,
    TenantReply,
)
from services.master.transfer import uploads_prefix

log = logging.getLogger(__name__)

#: Job records read at once (a tenant's records are kept until it removes them).
JOB_READS = 32


class Removal:
    """The master's answers to ``dataset-rm``, ``job-rm`` and ``export-rm``; one removal
    (or dataset add, or export) of a thing at a time in this master (:meth:`lock`)."""

    def __init__(self, js: JetStreamContext, jobs: KeyValue, policies: KeyValue) -> None:
        self.js = js
        self.jobs = jobs
        self.policies = policies
        self._locks: weakref.WeakValueDictionary[tuple[str, ...], asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )

    def lock(self, *key: str) -> asyncio.Lock:
        """The lock of one thing (``tenant, "dataset", id``...): a remove must not delete
        the objects an add has just checked and is recording."""
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    async def job_lock(self, tenant: str, job_id: str) -> asyncio.Lock:
        """The lock of a job's removal: its pipeline's, for a stage (a pipeline's removal
        takes its stages' versions and exported copies too)."""
        record, _ = await get_job(self.jobs, tenant, validate_id(job_id, "job id"))
        return self.lock(tenant, "job", record.parent if record and record.parent else job_id)

    # -- datasets ---------------------------------------------------------------------------

    async def dataset(self, request: RemoveDataset) -> TenantReply:
        """Take a dataset out of the tenant's namespace (record, then stored objects and the
        parts of an unfinished push), unless a job that has not ended names it."""
        tenant, dataset = request.tenant, validate_id(request.dataset, "dataset id")
        users = sorted(
            r.job_id for r in await self.live_jobs(tenant) if dataset in datasets_named(r)
        )
        if users:
            return CtlError(
                "invalid",
                f"dataset {dataset!r} is named by job(s) that have not ended: "
                f"{', '.join(users)}; cancel them or wait for them to end",
            )
        recorded = await delete_dataset(self.js, tenant, dataset)
        prefix = prefix_of(dataset)
        removed = await self._remove_from_bucket(
            tenant, [prefix, uploads_prefix(dataset)], first=prefix + MANIFEST
        )
        if not recorded and not removed.objects:
            return CtlError("not_found", f"no dataset {dataset!r} of tenant {tenant}")
        log.info("dataset %s/%s removed (%s)", tenant, dataset, removed)
        return DatasetRemoved(dataset, recorded, removed.objects, removed.bytes)

    # -- jobs -------------------------------------------------------------------------------

    async def job(self, request: RemoveJob) -> TenantReply:
        """Remove a job that has ended (and its stages) with its checkpoints, exported
        copies, events and records, unless a job that has not ended starts from it or
        evaluates it."""
        tenant, job_id = request.tenant, validate_id(request.job_id, "job id")
        records = await self.records(tenant)
        stages = sorted(r.job_id for r in records if r.parent == job_id)
        doomed = [job_id, *stages]
        by_id = {r.job_id: r for r in records}
        pipeline = by_id[job_id].parent if job_id in by_id else ""
        if pipeline and pipeline in by_id and by_id[pipeline].status not in TERMINAL_STATUSES:
            # Its next stage starts from it, and names it only once it starts.
            return CtlError(
                "invalid",
                f"job {job_id!r} is a stage of pipeline {pipeline!r}, which has not ended: "
                "cancel the pipeline or wait for it to end",
            )
        running = [j for j in doomed if j in by_id and by_id[j].status not in TERMINAL_STATUSES]
        if running:
            return CtlError(
                "invalid",
                f"job(s) {', '.join(running)} have not ended: cancel them "
                "(`joynexus cancel`) or wait for them to end",
            )
        users = sorted(
            r.job_id
            for r in records
            if r.status not in TERMINAL_STATUSES
            and r.job_id not in doomed
            and jobs_named(r) & set(doomed)
        )
        if users:
            return CtlError(
                "invalid",
                f"job {job_id!r} is needed by job(s) that have not ended: {', '.join(users)} "
                "(they start from its policy or evaluate it); cancel them or wait for them "
                "to end",
            )
        checkpoints = await self.js.object_store(subjects.OBJ_CHECKPOINTS)
        stored = await delete_under(checkpoints, [f"{tenant}/{j}/" for j in doomed])
        exported = await self._remove_from_bucket(tenant, [f"policies/{j}/" for j in doomed])
        events = 0
        for j in doomed:
            events += await self._purge_events(tenant, j)
            if (await get_policy(self.policies, tenant, j))[0] is not None:
                await self.policies.purge(job_key(tenant, j))
        recorded = [j for j in doomed if j in by_id]
        for j in reversed(recorded):  # the job's own record last: asking again finishes
            await self.jobs.purge(job_key(tenant, j))
        objects = Removed(stored.objects + exported.objects, stored.bytes + exported.bytes)
        if not recorded and not objects.objects and not events:
            return CtlError("not_found", f"no job {job_id!r} of tenant {tenant}")
        log.info("job %s/%s removed: %s, %d events, %s", tenant, job_id, recorded, events, objects)
        return JobRemoved(job_id, recorded, objects.objects, objects.bytes, events)

    # -- exported copies --------------------------------------------------------------------

    async def export(self, request: RemoveExport) -> TenantReply:
        """Delete the exported copy of one version of a job (``version`` 0: every one of the
        job's) from the tenant's bucket; its committed versions stay."""
        tenant, job_id = request.tenant, validate_id(request.job_id, "job id")
        if request.version < 0:
            return CtlError("invalid", f"version: {request.version} is negative")
        try:
            store = await tenant_store(self.js, tenant, create=False)
        except DatasetStoreError:
            store = None  # no bucket: nothing was ever exported
        found = {} if store is None else await objects_under(store, f"policies/{job_id}/")
        if request.version:
            wanted = policy_object(job_id, request.version)
            found = {name: info for name, info in found.items() if name == wanted}
        if store is None or not found:
            which = f"version {request.version}" if request.version else "any version"
            return CtlError(
                "not_found",
                f"no exported copy of {which} of job {job_id!r} of tenant {tenant} "
                "(`joynexus export` makes one)",
            )
        await delete_objects(store, found)
        versions = sorted(_exported_version(name) for name in found)
        size = sum(int(info.size or 0) for info in found.values())
        log.info("exports %s of %s/%s removed (%d bytes)", versions, tenant, job_id, size)
        return ExportRemoved(job_id, versions, size)

    async def _remove_from_bucket(
        self, tenant: str, prefixes: list[str], *, first: str = ""
    ) -> Removed:
        """Delete the objects of the tenant's bucket under ``prefixes``, ``first`` before
        the others (a dataset's manifest: nothing can materialise a dataset half deleted)."""
        try:
            store = await tenant_store(self.js, tenant, create=False)
        except DatasetStoreError:
            return Removed(0, 0)  # no bucket: nothing was ever stored
        return await delete_under(store, prefixes, first=first)

    async def _purge_events(self, tenant: str, job_id: str) -> int:
        """Purge the job's events; how many there were."""
        subject = subjects.events_of_job(tenant, job_id)
        info = await self.js.stream_info(subjects.STREAM_EVENTS, subjects_filter=subject)
        count = sum((info.state.subjects or {}).values())
        if count:
            await self.js.purge_stream(subjects.STREAM_EVENTS, subject=subject)
        return count

    # -- the tenant's jobs ------------------------------------------------------------------

    async def records(self, tenant: str) -> list[JobRecord]:
        """Every job record of the tenant, read :data:`JOB_READS` at a time."""
        prefix = f"{tenant}."
        keys = await kv_keys(self.js, subjects.KV_JOBS, prefix)
        out: list[JobRecord] = []
        for start in range(0, len(keys), JOB_READS):
            batch = keys[start : start + JOB_READS]
            found = await asyncio.gather(
                *(get_job(self.jobs, tenant, key[len(prefix) :]) for key in batch)
            )
            out += [record for record, _ in found if record is not None]
        return out

    async def live_jobs(self, tenant: str) -> list[JobRecord]:
        """The tenant's jobs that have not ended."""
        return [r for r in await self.records(tenant) if r.status not in TERMINAL_STATUSES]


def _exported_version(name: str) -> int:
    """The version of an exported copy ``policies/<job>/v<n>`` (0 for a name not of that
    form: an object the master did not write)."""
    number = name.rsplit("/v", 1)[-1]
    return int(number) if number.isdigit() else 0


def _specs(record: JobRecord) -> list[dict[str, object]]:
    """A job's spec and its stages' (a pipeline's); none for a spec that is not JSON."""
    try:
        doc = json.loads(record.spec_json)
    except ValueError:
        return []
    if not isinstance(doc, dict):
        return []
    stages = doc.get("stages")
    return [doc, *(s for s in (stages if isinstance(stages, list) else []) if isinstance(s, dict))]


def datasets_named(record: JobRecord) -> set[str]:
    """The datasets a job names: its spec's ``dataset`` and its stages' (only those fields:
    an env's keyword arguments may hold any key)."""
    return {v for s in _specs(record) if isinstance(v := s.get("dataset"), str)}


def jobs_named(record: JobRecord) -> set[str]:
    """The jobs a job needs: its ``init_from`` and an eval's ``policy_job``, its stages'."""
    return {
        v
        for s in _specs(record)
        for v in (s.get("init_from"), s.get("policy_job"))
        if isinstance(v, str)
    }
