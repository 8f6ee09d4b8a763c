"""Triage: what each buffered training message does before a round's grouped step.

Every round, each tenant's buffer is triaged (:meth:`Triage.buffer`): control messages open
and close slots, a low-level session's calls that need no backbone are applied at once,
RL episodes of the current iteration are held for the update, replays of work a committed
version already holds are settled (never applied twice), poison is dead-lettered, and the
first batch that is its job's next step is picked for the round. What must wait (a later
step, a slot whose ``OpenSlot`` is being redelivered) stays buffered, marked.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from bus.consume import Consumer
from bus.errors import HandlerError, PoisonError
from schemas.jobs import TERMINAL_STATUSES
from schemas.limits import InputLimits
from schemas.train import (
    SESSION_CALL_TYPES,
    CloseSlot,
    ForwardBackward,
    OpenSlot,
    RolloutBatch,
    SaveState,
    SessionCall,
    SFTBatch,
)
from services.trainer import session
from services.trainer.checks import check_call
from services.trainer.commit import Committer
from services.trainer.crashguard import CrashGuard, DeadLettered
from services.trainer.intake import Intake, MissingPayload, Waiting
from services.trainer.jobs import JobSlot
from services.trainer.ledger import Verdict, sft_verdict
from services.trainer.registry import WAIT, JobRegistry
from services.trainer.slots import Slots

if TYPE_CHECKING:
    from services.trainer.steps import Stepper

log = logging.getLogger(__name__)

Picked = tuple[Msg, SFTBatch | ForwardBackward, JobSlot]
"""A batch picked for the round: its message, its body and its job."""


async def settle_consumed(consumer: Consumer, msg: Msg, job: JobSlot) -> None:
    """Settle a message its job's committed version already holds; while that version's
    event is owed (a restored job), once the event is out: the replay is what brings a
    restarted trainer back to a job, and acking it first could lose the event for good
    if this trainer stopped again before publishing it."""
    if job.unannounced is not None:
        job.awaiting_event.append((msg, None))
    else:
        await consumer.settle(msg, None)


class Triage:
    """Triages the trainer's buffers (:mod:`~services.trainer.intake`) against its jobs."""

    def __init__(
        self,
        consumer: Consumer,
        intake: Intake,
        registry: JobRegistry,
        slots: Slots,
        guard: CrashGuard,
        committer: Committer,
        stepper: Stepper,
        limit: InputLimits,
    ) -> None:
        self.consumer = consumer
        self.intake = intake
        self.registry = registry
        self.slots = slots
        self.guard = guard
        self.committer = committer
        self.stepper = stepper
        self.limit = limit
        #: Session calls applied at triage (optim steps, saves, loads).
        self.inline_calls = 0

    async def buffer(self, tenant: str) -> Picked | None:
        """Settle what needs no training (control, poison, already consumed), hold RL episodes
        of the current iteration, and return the first batch that is its job's next step.
        Messages that must wait (a later step, a slot whose OpenSlot is being redelivered)
        stay buffered, marked WAIT."""
        ready: Picked | None = None
        kept: list[tuple[Msg, object]] = []
        for msg, item in self.intake.buffers[tenant]:
            body = item.body if isinstance(item, Waiting) else item
            try:
                verdict = await self.decide(msg, body)
            except HandlerError as exc:
                await self.consumer.settle(msg, exc)
                continue
            except (NatsError, TimeoutError) as exc:  # the broker is away: try next round
                log.warning("triage of %s failed: %s", msg.subject, exc)
                kept.append((msg, item))
                continue
            if verdict is Verdict.APPLY and ready is None:
                assert isinstance(body, SFTBatch | ForwardBackward)
                ready = (msg, body, self.registry.jobs[f"{body.tenant}/{body.job_id}"])
                kept.append((msg, body))
            elif verdict is Verdict.WAIT or verdict is Verdict.APPLY:
                kept.append((msg, Waiting(body)))
            # CONSUMED / COLLECT: settled or held by decide()
        self.intake.buffers[tenant] = kept
        return ready

    async def decide(self, msg: Msg, body: object) -> Verdict:
        """Settle, hold or keep one buffered message; raises the error to settle it with."""
        if isinstance(body, HandlerError):
            raise body
        if isinstance(body, OpenSlot):
            return await self.open_slot(msg, body)
        if isinstance(body, CloseSlot):
            await self.close_slot(body)
            await self.consumer.settle(msg, None)
            return Verdict.CONSUMED
        assert isinstance(body, (SFTBatch, RolloutBatch, MissingPayload, *SESSION_CALL_TYPES))
        try:
            # Restoring a job's slot (its checkpoint read and loaded) is work it starts.
            job = await self.registry.job_for(
                body.tenant, body.job_id, restoring=self.guard.started(msg)
            )
        except DeadLettered:
            return Verdict.CONSUMED  # its job's restore killed the process: the job fails
        if not isinstance(job, JobSlot):
            if job is WAIT:
                return Verdict.WAIT  # its OpenSlot is being redelivered
            await self.consumer.settle(msg, None)  # the job ended: nothing to apply
            return Verdict.CONSUMED
        if job.closed or self.registry.status.get(job.key) in TERMINAL_STATUSES:
            # Ended (its CloseSlot may still be behind a backlog): nothing more to apply.
            await self.consumer.settle(msg, None)
            return Verdict.CONSUMED
        if isinstance(body, MissingPayload):
            if body.ref.step < job.committed_batches:
                # A redelivery of a message acknowledged after its commit (its object was
                # deleted then): already applied.
                await settle_consumed(self.consumer, msg, job)
                return Verdict.CONSUMED
            raise body.error
        if isinstance(body, RolloutBatch):
            return await self.stepper.collect(msg, body, job)
        if isinstance(body, SESSION_CALL_TYPES):
            return await self.session_call(msg, body, job)
        if job.spec.session:
            raise job.error(f"SFT batch sent to session {body.job_id!r}", fatal=False)
        if job.spec.rl is not None:
            raise job.error(f"SFT batch sent to RL job {body.job_id!r}")
        verdict = sft_verdict(job.batches_done, body.step, job.committed_batches)
        if verdict is Verdict.CONSUMED:
            # Already applied (a replay after a crash, or a re-publish after the duplicate
            # window): never apply twice.
            await settle_consumed(self.consumer, msg, job)
        return verdict

    async def session_call(self, msg: Msg, call: SessionCall, job: JobSlot) -> Verdict:
        """A low-level session's call: applied now (no backbone needed), left for the round's
        grouped step (a forward), kept waiting (a later call), or consumed (done already)."""
        if not job.spec.session:
            raise job.error(f"{session.op_of(call)} sent to job {call.job_id!r}, not a session")
        if job.save_as is not None:
            return Verdict.WAIT  # a save not committed yet: nothing moves until it lands
        verdict = sft_verdict(job.batches_done, call.call, job.committed_batches)
        if verdict is Verdict.APPLY and isinstance(call, ForwardBackward):
            try:
                check_call(call, self.limit)
            except PoisonError as exc:
                self.stepper.book_call(msg, call, job, ValueError(str(exc)))
                await self.committer.publish_results(job)
                return Verdict.CONSUMED
        if verdict is Verdict.CONSUMED:
            if isinstance(call, SaveState) and session.saved_by(job, call):
                # Committed, maybe unanswered (a crash right after): answer it again. A copy
                # of a call refused for a name another call saved was answered (its error
                # went out before its commit) and gets nothing more.
                job.results.append(session.saved_result(job, call))
                await self.committer.publish_results(job)
            await settle_consumed(self.consumer, msg, job)
        if verdict is not Verdict.APPLY or isinstance(call, ForwardBackward):
            return verdict
        try:
            # Taken back also when it raises (the broker away: tried again next round).
            async with self.guard.started(msg):
                answer = await session.apply_now(self.registry, self.slots, job, call)
        except DeadLettered:
            job.closed = True  # its handling killed the process too often: the job fails
            return Verdict.CONSUMED
        self.inline_calls += 1
        job.applied_seq = max(job.applied_seq, msg.metadata.sequence.stream)
        job.held.append((msg, None))
        if answer is not None:
            job.results.append(answer)
            await self.committer.publish_results(job)
        else:  # a save: its commit, now, answers it with the version
            await self.committer.commit(job)
        return Verdict.CONSUMED

    # -- slots -------------------------------------------------------------------------------
    async def open_slot(self, msg: Msg, spec: OpenSlot) -> Verdict:
        """Open the job's slot (consumed once its first version is committed); a replay of
        an open job's OpenSlot waits while that first version is not committed yet (acked,
        it could leave the job with no record and no OpenSlot), then is consumed."""
        try:
            # Opening the slot (its head built, an init checkpoint loaded) is work it starts.
            job = await self.registry.open_job(
                spec, msg.metadata.sequence.stream, opening=self.guard.started(msg)
            )
        except DeadLettered:
            return Verdict.CONSUMED  # opening this slot killed the process: the job fails
        if job is None:  # already open (a replayed OpenSlot), or its opening dead-lettered
            # Restored if it is not resident: its committed version's event may be owed
            # (for an RL job or a session it is what brings the rest of the job's work).
            try:
                existing = await self.registry.job_for(
                    spec.tenant, spec.job_id, restoring=self.guard.started(msg)
                )
            except DeadLettered:
                return Verdict.CONSUMED
            if isinstance(existing, JobSlot):
                if existing.kv_revision == 0:
                    return Verdict.WAIT  # its first version is not committed yet
                await settle_consumed(self.consumer, msg, existing)
            else:
                await self.consumer.settle(msg, None)
            return Verdict.CONSUMED
        job.held.append((msg, None))
        await self.committer.commit(job, initial=True)
        log.info("opened slot %s (%s head, %d steps)", job.key, spec.head.kind, spec.total_steps)
        return Verdict.CONSUMED

    async def close_slot(self, close: CloseSlot) -> None:
        job = self.registry.close(close.tenant, close.job_id)
        if job is not None:
            # A commit in flight that fails gives its messages back to job.held: wait for
            # it, so that none is left held (and kept alive) on a job nothing commits again.
            await self.committer.drain([job])
            # Their effect is in the final checkpoint, or abandoned with the job.
            await self.consumer.release([m for m, _ in job.held])
            await self.consumer.release([m for m, _ in job.awaiting_event])
            if job.pending is not None:
                await self.consumer.release([m for m, _ in job.pending.covered])
            await self.consumer.release([m for m, _ in job.rollouts.values()])
            log.info("closed slot %s (%s)", job.key, close.reason)
