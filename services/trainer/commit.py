"""The trainer's commit: a job's next version frozen at a round boundary and written
(:mod:`services.trainer.versions`) in the background, then its ``policy`` event, then the
messages the checkpoint contains settled; retried as it was when the broker could not take
it, one per job in flight (:class:`Committer`)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError
from opentelemetry import trace

from bus import checkpoints as ckpt
from bus import records, tracing
from bus.consume import Consumer
from bus.errors import HandlerError
from bus.metering import BusyMeter
from bus.usage import UsageMeter
from schemas.events import CallResult, PolicyPublished
from schemas.train import PolicyRecord
from services.trainer.crashguard import CrashGuard
from services.trainer.versions import Frozen, freeze, write_version
from vla.slot import TenantSlot

log = logging.getLogger(__name__)

#: A commit that did not land, or an owed ``policy`` event, is tried again after this long.
RETRY_S = 1.0

if TYPE_CHECKING:
    from services.trainer.jobs import JobSlot
    from services.trainer.registry import JobRegistry


@dataclass(frozen=True)
class _At:
    """What a commit records of its job, taken when the slot is frozen (not when it lands)."""

    applied_seq: int
    batches_done: int
    metrics: dict[str, float]
    finished: bool
    #: A session's save_state (name, call) this version answers.
    save_as: tuple[str, int] | None

    @classmethod
    def of(cls, job: JobSlot) -> _At:
        # job.save_as stays set until a commit carrying it lands: the session's calls wait
        # (services.trainer.triage.Triage.session_call), so any retry freezes the same state.
        return cls(job.applied_seq, job.batches_done, dict(job.metrics), job.finished, job.save_as)


@dataclass(frozen=True)
class PendingCommit:
    """A commit that did not land: tried again exactly as it was."""

    covered: list[tuple[Msg, HandlerError | None]]
    frozen: Frozen
    at: _At
    initial: bool


def save_result(job: JobSlot, call: int, record: PolicyRecord) -> CallResult:
    """The answer to a session's ``save_state`` call that ``record`` committed."""
    spec = job.spec
    return CallResult(
        spec.tenant,
        spec.job_id,
        call,
        "save_state",
        {"step": float(record.step)},
        time.time(),
        version=record.version,
    )


class Committer:
    """The trainer's commit: :func:`write_version` → ``policy`` event → settle the messages
    the checkpoint holds (acked, or dead-lettered with the error they were dropped for) →
    prune old versions to the retention setting.

    Off the critical path: :meth:`start` freezes the slot at the round boundary (a copy of
    its bytes, a few ms for a head) and writes the checkpoint, the KV entry and the event,
    then settles, in a background task while the next rounds train. One commit per job is in
    flight at a time (the next needs the KV revision this one writes); :meth:`drain` waits
    for them (at a stop, or before a commit that must be awaited)."""

    def __init__(
        self,
        registry: JobRegistry,
        consumer: Consumer,
        emit: Callable[..., Awaitable[None]],
        keep_versions: int,
        crash_after_commits: int = 0,
        active: BusyMeter | None = None,
        usage: UsageMeter | None = None,
    ) -> None:
        self.registry = registry
        self.consumer = consumer
        self.guard = CrashGuard(consumer)
        self.emit = emit
        self.keep_versions = keep_versions
        #: Fault injection: SIGKILL this process after this many commits, before the acks.
        self.crash_after_commits = crash_after_commits
        self.commits = 0
        #: Seconds the trainer loop waited on commits (freezing, or awaited commits).
        self.blocking_s = 0.0
        #: In-flight background commits by job key.
        self.in_flight: dict[str, asyncio.Task[object]] = {}
        #: Seconds commits took (checkpoint, KV, event, settling), summed; and the trainer's
        #: work-in-hand meter, which counts a commit's time too.
        self.commit_s = 0.0
        self.active = active or BusyMeter()
        self.usage = usage or UsageMeter()

    def busy(self, job: JobSlot) -> bool:
        """Whether a commit of ``job`` is in flight."""
        return job.key in self.in_flight

    def start(self, job: JobSlot) -> bool:
        """Freeze ``job``'s slot now and commit it in the background. Returns False (nothing
        started) while a commit of the job is still in flight, or for a job whose commit was
        dead-lettered."""
        if self.busy(job) or job.commit_dead:
            return False
        t0 = time.perf_counter()
        work: Coroutine[object, object, object]
        if job.unannounced is not None:
            # Only the owed event: the version it names must be out before another is taken.
            work = self._announce_owed(job)
        elif job.pending is not None:
            pending, job.pending = job.pending, None
            work = self._commit(job, pending.covered, pending.frozen, pending.at, pending.initial)
        else:
            covered, job.held = job.held, []
            frozen = freeze(self._resident_slot(job))
            # What the checkpoint records is what the job stands at now, not when it lands.
            work = self._commit(job, covered, frozen, _At.of(job))
        task = asyncio.ensure_future(work)
        self.blocking_s += time.perf_counter() - t0
        self.in_flight[job.key] = task
        task.add_done_callback(lambda _: self.in_flight.pop(job.key, None))
        return True

    async def commit(self, job: JobSlot, initial: bool = False) -> None:
        """Commit the job's slot and wait for it (after any commit of it in flight, its owed
        event and a commit that did not land: nothing newer is committed before those). A
        commit the broker could not take is tried again at the next chance, as it was
        (nothing was settled). With nothing new since the last version (and not
        ``initial``), no version is taken."""
        t0 = time.perf_counter()
        if job.commit_dead:
            return
        if await self.covers_suspect(job):
            # It may be what killed the process: it runs alone (the caller awaits it: no
            # step runs beside it either).
            await self.drain()
        else:
            await self.drain([job])
        if job.unannounced is not None and not await self._announce_owed(job):
            return
        if job.pending is not None:
            pending, job.pending = job.pending, None
            await self._commit(job, pending.covered, pending.frozen, pending.at, pending.initial)
            if job.commit_dead or job.pending is not None or job.unannounced is not None:
                return  # still not landed, or its event not out: nothing newer goes first
        if initial or job.batches_done > job.committed_batches or job.held or job.save_as:
            covered, job.held = job.held, []
            frozen = freeze(self._resident_slot(job))
            await self._commit(job, covered, frozen, _At.of(job), initial)
        self.blocking_s += time.perf_counter() - t0

    async def covers_suspect(self, job: JobSlot) -> bool:
        """Whether the job's next commit covers a message that was in flight when the
        process died before (a suspect, :mod:`services.trainer.crashguard`)."""
        covering = [m for m, _ in job.held]
        if job.pending is not None:
            covering += [m for m, _ in job.pending.covered]
        return await self.guard.suspect({job.key: covering}) is not None

    def _resident_slot(self, job: JobSlot) -> TenantSlot:
        """The job's slot as the slot manager holds it: ``job.slot`` may be an object the
        manager evicted since (its bytes stored), whose version bump the next restore would
        not see, so one version number would be published twice."""
        try:
            job.slot = self.registry.slots.acquire([job.key])[0]
        except KeyError:  # closed: the manager forgot it, job.slot is all there is
            pass
        return job.slot

    async def drain(self, jobs: Iterable[JobSlot] | None = None, within_s: float = 60.0) -> None:
        """Wait (at most ``within_s``) for the in-flight commits of ``jobs`` (default: all)."""
        keys = None if jobs is None else {j.key for j in jobs}
        tasks = [t for k, t in self.in_flight.items() if keys is None or k in keys]
        if tasks:
            await asyncio.wait(tasks, timeout=within_s)

    async def _commit(
        self,
        job: JobSlot,
        covered: list[tuple[Msg, HandlerError | None]],
        frozen: Frozen,
        at: _At,
        initial: bool = False,
    ) -> None:
        t0 = time.perf_counter()
        # In the job's trace: a child of the last message the version covers.
        parent = tracing.extract(covered[-1][0].headers) if covered else None
        attributes = {
            **tracing.job_attributes(job.spec.tenant, job.spec.job_id),
            "messaging.batch.message_count": len(covered),
            "joynexus.initial": initial,
        }
        with (
            tracing.tracer().start_as_current_span(
                "checkpoint commit", context=parent, attributes=attributes
            ),
            self.active.busy(),
        ):
            await self._commit_metered(job, covered, frozen, at, initial)
        self.commit_s += time.perf_counter() - t0

    async def _commit_metered(
        self,
        job: JobSlot,
        covered: list[tuple[Msg, HandlerError | None]],
        frozen: Frozen,
        at: _At,
        initial: bool,
    ) -> None:
        # Writing the version (its state serialised, stored) is work its messages start: a
        # commit that kills the process (out of memory serialising a large head) counts them,
        # so its crash loop ends in their dead letters and its job's failure instead of
        # going on until the server stops redelivering them (crashguard.py).
        msgs = [msg for msg, _ in covered]
        dead = await self.guard.begin(msgs)
        if dead:
            # Dead-lettered (their job hears why and fails): nothing of it is committed
            # again, and the others are consumed with the failing job, as its later
            # messages are.
            job.closed = job.commit_dead = True
            others = [(m, e) for m, e in covered if not any(m is d for d in dead)]
            await self.guard.returned(m for m, _ in others)
            for msg, error in others:  # a dropped step's still dead-lettered with its error
                await self.consumer.settle(msg, error)
            log.error("commit of %s killed the process too often: its job fails", job.key)
            return
        try:
            # A session's call results go out before their calls can be acked: after a
            # crash past this point the calls are not applied again, so nothing would.
            if not await self.publish_results(job):
                raise TimeoutError("call results not published")
            record = await self._write(job, frozen, at, initial)
        except (NatsError, TimeoutError, records.RevisionConflict) as exc:
            log.warning("commit of %s failed (%s); trying again", job.key, exc)
            self._retry_later(job, PendingCommit(covered, frozen, at, initial))
            return
        except Exception:  # a bug: keep the messages for the next commit, and say so loudly
            log.exception("commit of %s failed; trying again", job.key)
            self._retry_later(job, PendingCommit(covered, frozen, at, initial))
            return
        finally:
            await self.guard.returned(msgs)
        trace.get_current_span().set_attributes(
            {"joynexus.version": record.version, "joynexus.step": record.step}
        )
        self.usage.charge(job.spec.tenant, job.spec.job_id, checkpoint_bytes=len(frozen.data))
        if at.save_as is not None:
            if job.save_as == at.save_as:
                job.save_as = None  # the session's calls may go on
            job.results.append(save_result(job, at.save_as[1], record))
        # The version is committed from here on, whatever is not out yet: its number is
        # not given back (the next commit takes the next one).
        self.commits += 1
        job.versions.append(record.object_name)
        if not await self.announce(job):
            # Its messages are settled once the event is out (the next commit does only that).
            job.awaiting_event = covered + job.awaiting_event
            job.retry_at = time.monotonic() + RETRY_S
            return
        # With replays triaged while the event was being published (they waited for it).
        covered, job.awaiting_event = covered + job.awaiting_event, []
        if not await self.publish_results(job):
            # Committed, but an answer is not out: its call is settled only after it is
            # (the next commit publishes first); a replay meanwhile answers a save again.
            job.held = covered + job.held
            return
        if self.crash_after_commits and self.commits >= self.crash_after_commits:
            log.warning("fault injection: SIGKILL after commit %d, before its acks", self.commits)
            os.kill(os.getpid(), signal.SIGKILL)
        for msg, error in covered:
            await self.consumer.settle(msg, error)
        await self._prune(job)

    def _retry_later(self, job: JobSlot, pending: PendingCommit) -> None:
        """A commit that did not land is tried again as it was, a second later at the
        earliest: its version number stays taken (an RL job's version ``v`` is its policy
        after ``v - 1`` iterations, and the master plans each iteration's rollouts by it),
        and a write that landed unseen is replaced by the very same bytes."""
        job.pending = pending
        job.retry_at = time.monotonic() + RETRY_S

    async def _prune(self, job: JobSlot) -> None:
        """Delete the job's checkpoints past the retention setting (one the store does not
        delete now is left behind, said in the log: the job goes on)."""
        while len(job.versions) > self.keep_versions:
            old = job.versions.popleft()
            if old in job.saved.values():
                continue  # a session's saved state outlives the retention
            try:
                await self.registry.store.delete(old)
            except NotFoundError:
                pass
            except (NatsError, TimeoutError) as exc:
                log.warning("old checkpoint %s of %s not deleted: %s", old, job.key, exc)

    async def _announce_owed(self, job: JobSlot) -> bool:
        """Publish the committed version's owed event, then (once a session's answers are
        out too) settle the messages that version holds; whether the event is out (else it is
        tried again a second later)."""
        if not await self.announce(job):
            job.retry_at = time.monotonic() + RETRY_S
            return False
        covered, job.awaiting_event = job.awaiting_event, []
        if not await self.publish_results(job):
            # An answer is not out: its call is settled after the next commit publishes it.
            job.held = covered + job.held
            return True
        for msg, error in covered:
            await self.consumer.settle(msg, error)
        return True

    async def announce(self, job: JobSlot) -> bool:
        """Publish the ``policy`` event the job owes (its latest committed version's); whether
        none is owed now. The event's id is its version: a retry that did land is a no-op."""
        event = job.unannounced
        if event is None:
            return True
        try:
            await self.emit(event)
        except (NatsError, TimeoutError) as exc:
            log.warning("event of %s version %d not published: %s", job.key, event.version, exc)
            return False
        except Exception:  # a bug: the event stays owed, said loudly
            log.exception("event of %s version %d not published", job.key, event.version)
            return False
        if job.unannounced is event:
            job.unannounced = None
        return True

    async def publish_results(self, job: JobSlot) -> bool:
        """Publish the session's pending call results; whether all went out (those that did
        not stay pending)."""
        async with job.publish_lock:
            if not job.results:
                return True
            pending, job.results = job.results, []
            outcomes = await asyncio.gather(
                *(self.emit(r, step_id=r.call) for r in pending), return_exceptions=True
            )
            failed = [
                r for r, o in zip(pending, outcomes, strict=True) if isinstance(o, BaseException)
            ]
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    log.warning("call result of %s not published: %s", job.key, outcome)
                    break
            job.results = failed + job.results
            return not failed

    async def commit_applied(self, jobs: Iterable[JobSlot], within_s: float) -> None:
        """On stop: let in-flight commits land, then commit what was applied (so it is
        acked), as far as ``within_s`` allows; whatever is left is handed back and replayed."""
        deadline = time.monotonic() + within_s
        await self.drain(within_s=within_s)
        for job in list(jobs):
            if time.monotonic() > deadline or self.busy(job):
                return
            if (
                job.batches_done > job.committed_batches
                or job.held
                or job.unannounced
                or job.pending
            ):
                await self.commit(job)

    async def _write(
        self,
        job: JobSlot,
        frozen: Frozen,
        at: _At,
        initial: bool,
    ) -> PolicyRecord:
        def write(revision: int | None) -> Awaitable[tuple[PolicyRecord, int]]:
            return write_version(
                self.registry.store,
                self.registry.policies,
                job.spec,
                job.slot,
                revision=revision,
                stream_seq=at.applied_seq,
                batches_done=at.batches_done,
                metrics=at.metrics,
                frozen=frozen,
                saved=job.saved,
                saved_calls=job.saved_calls,
                save_as=at.save_as,
            )

        try:
            record, job.kv_revision = await write(None if initial else job.kv_revision)
        except records.RevisionConflict:
            # A write of this same version whose answer was lost (a timeout while the broker
            # or a cluster node went away) may have landed: then it is ours to replace.
            landed, revision = await records.get_policy(
                self.registry.policies, job.spec.tenant, job.spec.job_id
            )
            ours = ckpt.digest(await frozen.serialised())
            if landed is None or landed.version != frozen.version or landed.sha256 != ours:
                raise  # another writer's version: never replaced
            record, job.kv_revision = await write(revision)
        job.saved, job.saved_calls = dict(record.saved), dict(record.saved_calls)
        job.committed_seq, job.committed_step = record.stream_seq, record.step
        job.committed_batches = record.batches_done
        job.last_commit_at = time.monotonic()
        job.unannounced = PolicyPublished(
            job.spec.tenant,
            job.spec.job_id,
            record.version,
            record.object_name,
            record.step,
            time.time(),
            final=at.finished,
        )
        return record
