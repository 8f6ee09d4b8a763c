"""The commit protocol's durable half: checkpoint the slot into the ``checkpoints`` object
store under a content-hashed name, then advance the job's ``policies`` KV entry with
compare-and-set. Only after both may the trainer announce the version and ack the messages
the checkpoint contains (:meth:`services.trainer.service.Trainer.commit`).

:func:`write_version` is also what tests use to publish a policy version exactly as the
trainer does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus import checkpoints as ckpt
from bus import records
from bus.consume import Consumer
from schemas.events import PolicyPublished
from schemas.train import OpenSlot, PolicyRecord
from vla.slot import TenantSlot

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from services.trainer.jobs import JobSlot
    from services.trainer.registry import JobRegistry


async def write_version(
    store: ObjectStore,
    policies: KeyValue,
    spec: OpenSlot,
    slot: TenantSlot,
    *,
    revision: int | None,
    stream_seq: int = 0,
    batches_done: int = 0,
    metrics: dict[str, float] | None = None,
) -> tuple[PolicyRecord, int]:
    """Publish the slot's next version: checkpoint object, then the KV entry (created when
    ``revision`` is None or 0, else updated only if still at ``revision``: a lost race raises
    :class:`bus.records.RevisionConflict`). Returns the record and the new revision."""
    # Versions count from 1 (the initial weights): 0 means "none" / "latest" elsewhere.
    slot.publish_version()
    data = await asyncio.to_thread(slot.to_bytes)
    sha = ckpt.digest(data)
    name = ckpt.object_name(spec.tenant, spec.job_id, slot.version, sha)
    await ckpt.put_checkpoint(store, name, data)
    record = PolicyRecord(
        spec.tenant,
        spec.job_id,
        slot.version,
        slot.step,
        name,
        sha,
        stream_seq,
        spec,
        time.time(),
        dict(metrics or {}),
        batches_done,
    )
    return record, await records.put_policy(policies, record, last=revision or 0)


class Committer:
    """The trainer's commit: :func:`write_version` → ``policy`` event → settle the messages
    the checkpoint holds (acked, or dead-lettered with the error they were dropped for) →
    prune old versions to the retention setting."""

    def __init__(
        self,
        registry: JobRegistry,
        consumer: Consumer,
        emit: Callable[[PolicyPublished], Awaitable[None]],
        keep_versions: int,
        crash_after_commits: int = 0,
    ) -> None:
        self.registry = registry
        self.consumer = consumer
        self.emit = emit
        self.keep_versions = keep_versions
        #: Fault injection: SIGKILL this process after this many commits, before the acks.
        self.crash_after_commits = crash_after_commits
        self.commits = 0

    async def commit(self, job: JobSlot, initial: bool = False) -> None:
        """Commit the job's slot. A commit the broker could not take is tried again at the
        next chance (nothing was settled)."""
        covered, job.held = job.held, []
        try:
            record = await self._write(job, initial)
        except (NatsError, TimeoutError) as exc:
            log.warning("commit of %s failed (%s); trying again", job.key, exc)
            job.held = covered + job.held
            return
        self.commits += 1
        if self.crash_after_commits and self.commits >= self.crash_after_commits:
            log.warning("fault injection: SIGKILL after commit %d, before its acks", self.commits)
            os.kill(os.getpid(), signal.SIGKILL)
        for msg, error in covered:
            await self.consumer.settle(msg, error)
        job.versions.append(record.object_name)
        while len(job.versions) > self.keep_versions:
            with contextlib.suppress(NotFoundError):
                await self.registry.store.delete(job.versions.popleft())

    async def commit_applied(self, jobs: Iterable[JobSlot], within_s: float) -> None:
        """On stop: commit what was applied (so it is acked), as far as ``within_s`` allows;
        whatever is left is handed back and replayed."""
        deadline = time.monotonic() + within_s
        for job in list(jobs):
            if time.monotonic() > deadline:
                return
            if job.batches_done > job.committed_batches or job.held:
                await self.commit(job)

    async def _write(self, job: JobSlot, initial: bool) -> PolicyRecord:
        record, job.kv_revision = await write_version(
            self.registry.store,
            self.registry.policies,
            job.spec,
            job.slot,
            revision=None if initial else job.kv_revision,
            stream_seq=job.applied_seq,
            batches_done=job.batches_done,
            metrics=job.metrics,
        )
        job.committed_seq, job.committed_step = record.stream_seq, record.step
        job.committed_batches = record.batches_done
        job.last_commit_at = time.monotonic()
        await self.emit(
            PolicyPublished(
                job.spec.tenant,
                job.spec.job_id,
                record.version,
                record.object_name,
                record.step,
                time.time(),
                final=job.finished,
            )
        )
        return record
