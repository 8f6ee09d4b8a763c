"""The trainer's jobs: which are open here, restored from their checkpoints on demand, and
what the ``jobs`` KV says of the rest (a cancelled or failed job's messages are consumed
unapplied)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus import checkpoints as ckpt
from bus import records
from bus.codec import DecodeError
from schemas import subjects
from schemas.events import PolicyPublished
from schemas.jobs import TERMINAL_STATUSES
from schemas.train import OpenSlot
from services.trainer.announce import announced_version
from services.trainer.crashguard import DeadLettered
from services.trainer.jobs import JobError, JobSlot
from services.trainer.slots import Slots

log = logging.getLogger(__name__)


class _Wait:
    """Marker: the job is live but its slot is not open here yet (its OpenSlot is being
    redelivered); its messages wait in the buffer."""

    def __repr__(self) -> str:
        return "WAIT"


WAIT = _Wait()


class JobRegistry:
    """Open jobs by ``tenant/job`` key, and the mirror of the ``jobs`` KV statuses."""

    def __init__(self, js: JetStreamContext, slots: Slots, keep_versions: int) -> None:
        self.js = js
        self.slots = slots
        self.keep_versions = keep_versions
        self.jobs: dict[str, JobSlot] = {}
        self.status: dict[str, str] = {}
        #: Jobs whose slot's opening or restore was dead-lettered (it killed the process too
        #: often): failing, so their other messages are consumed unapplied, not opened or
        #: restored from again.
        self.dead_lettered: set[str] = set()
        self.policies: KeyValue
        self.jobs_kv: KeyValue
        self.store: ObjectStore

    async def connect(self) -> None:
        self.policies = await self.js.key_value(subjects.KV_POLICIES)
        self.jobs_kv = await self.js.key_value(subjects.KV_JOBS)
        self.store = await self.js.object_store(subjects.OBJ_CHECKPOINTS)

    def observe_job(self, entry: KeyValue.Entry) -> None:
        """One ``jobs`` KV entry (cancellations reach the trainer this way)."""
        try:
            record = records.job_of(entry)
        except DecodeError:
            return
        if record is not None:
            self.status[f"{record.tenant}/{record.job_id}"] = record.status

    async def status_of(self, tenant: str, job_id: str) -> str | None:
        """The job's status (the mirror, read through on a miss)."""
        key = f"{tenant}/{job_id}"
        if key not in self.status:
            record, _ = await records.get_job(self.jobs_kv, tenant, job_id)
            if record is not None:
                self.status[key] = record.status
        return self.status.get(key)

    @contextlib.asynccontextmanager
    async def _counted(
        self, key: str, work: contextlib.AbstractAsyncContextManager[object] | None
    ) -> AsyncIterator[None]:
        """The block (a slot's opening or restore) inside ``work``, the crash ledger's count
        of it; a job whose opening or restore was dead-lettered is not tried again."""
        try:
            async with work or contextlib.nullcontext():
                yield
        except DeadLettered:
            self.dead_lettered.add(key)
            raise

    async def job_for(
        self,
        tenant: str,
        job_id: str,
        restoring: contextlib.AbstractAsyncContextManager[object] | None = None,
    ) -> JobSlot | _Wait | None:
        """The job's slot: resident, or restored from its latest checkpoint (inside
        ``restoring``, when given: the crash ledger counts a restore as work its message
        started); None if the job has ended; WAIT if it is live but its slot is not open
        yet. Raises :class:`JobError` for a job nobody submitted or a slot that cannot be
        restored; what ``restoring`` raises (its restore was dead-lettered: the job is
        failing, and it is not restored again for its other messages)."""
        key = f"{tenant}/{job_id}"
        if key in self.jobs:
            return self.jobs[key]
        if key in self.dead_lettered or self.status.get(key) in TERMINAL_STATUSES:
            return None
        record, revision = await records.get_policy(self.policies, tenant, job_id)
        if record is None:
            status = await self.status_of(tenant, job_id)
            if status in ("accepted", "queued", "running"):
                return WAIT
            if status in TERMINAL_STATUSES:
                return None
            if await records.job_removed(self.jobs_kv, tenant, job_id):
                return None  # removed by its tenant (it had ended): nothing to apply
            raise JobError(f"no slot is open for job {job_id!r} of tenant {tenant!r}", job_id)
        async with self._counted(key, restoring):
            try:
                data = await ckpt.get_checkpoint(self.store, record.object_name, record.sha256)
            except ckpt.CheckpointError as exc:
                raise JobError(f"cannot restore the slot: {exc}", job_id) from exc
            # Committed with its event not out (the trainer stopped first): it is owed still.
            owed = await announced_version(self.js, tenant, job_id) < record.version
            slot = self.slots.restore(key, job_id, data)
        job = JobSlot(
            record.slot,
            slot,
            self.slots.normaliser(record.slot.num_views, record.slot.token_budget),
            revision,
            applied_seq=record.stream_seq,
            committed_seq=record.stream_seq,
            committed_step=record.step,
            batches_done=record.batches_done,
            committed_batches=record.batches_done,
            versions=deque([record.object_name]),
            metrics=dict(record.metrics),
            saved=dict(record.saved),
            saved_calls=dict(record.saved_calls),
        )
        if owed:
            job.unannounced = PolicyPublished(
                tenant,
                job_id,
                record.version,
                record.object_name,
                record.step,
                time.time(),
                final=record.batches_done >= record.slot.total_steps,
            )
        self.jobs[key] = job
        await ckpt.prune(
            self.store,
            tenant,
            job_id,
            slot.version - self.keep_versions + 1,
            keep=set(record.saved.values()),
        )
        log.info(
            "restored %s at step %d (v%d, seq %d)", key, slot.step, slot.version, record.stream_seq
        )
        return job

    async def open_job(
        self,
        spec: OpenSlot,
        seq: int,
        opening: contextlib.AbstractAsyncContextManager[object] | None = None,
    ) -> JobSlot | None:
        """Create the job's slot (inside ``opening``, when given, as :meth:`job_for`'s
        ``restoring``); None if it exists already (a replayed OpenSlot), its opening was
        dead-lettered before, or the job was removed (an OpenSlot left behind)."""
        key = f"{spec.tenant}/{spec.job_id}"
        if (
            key in self.jobs
            or key in self.dead_lettered
            or (await records.get_policy(self.policies, spec.tenant, spec.job_id))[0]
            or await records.job_removed(self.jobs_kv, spec.tenant, spec.job_id)
        ):
            return None
        async with self._counted(key, opening):
            init = None
            if spec.init_object:
                try:
                    init = await ckpt.get_checkpoint(self.store, spec.init_object, spec.init_sha256)
                except ckpt.CheckpointError as exc:
                    raise JobError(f"cannot initialise the slot: {exc}", spec.job_id) from exc
            slot = self.slots.create(key, spec, init)
        job = JobSlot(
            spec,
            slot,
            self.slots.normaliser(spec.num_views, spec.token_budget),
            0,
            applied_seq=seq,
        )
        self.jobs[key] = job
        return job

    def close(self, tenant: str, job_id: str) -> JobSlot | None:
        key = f"{tenant}/{job_id}"
        job = self.jobs.pop(key, None)
        if job is not None:
            job.closed = True
            self.slots.remove(key)
        return job
