"""Trainer: the Training Model Service.

One process holds the frozen backbone and many tenant slots. It consumes the Training Queue
through one durable pull consumer per (backbone, tenant) (:class:`bus.durables.DurableSet`,
discovered from the ``TRAIN`` stream's subjects). Each round, every tenant's buffer is triaged
(:meth:`Trainer.triage`: control messages, replays and poison are settled, the next applicable
batch found — :mod:`~services.trainer.ledger`), deficit round robin picks the tenants served
under the slot budget (:mod:`~services.trainer.scheduler`), and their batches go through ONE
grouped backbone forward, then a step per tenant; complete RL iterations are updated likewise
(:mod:`~services.trainer.rl`).

Commit protocol (exactly-once steps): checkpoint + ``policies`` KV compare-and-set
(:mod:`~services.trainer.commit`) → ``policy`` event → settle the messages the checkpoint
contains. Until then they are held (kept alive by the consume runtime). A crash anywhere
replays unacked messages; the restored slot's progress recognises what it already contains.

Nothing waits that need not: a commit freezes the slot at the round boundary and is written
in the background while the next rounds train (one per job in flight); the buffers are topped
up while a round computes in its thread; a job that starts running wakes tenant discovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import torch
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.kv import KeyValue

from bus.auth import reply_allowed
from bus.codec import DecodeError, decode, encode
from bus.durable import ConsumerSpec
from bus.durables import DurableSet
from bus.encoding import FeatureClient
from bus.errors import HandlerError, PoisonError
from bus.metering import BusyMeter
from bus.placement import placed
from bus.queues import per_tenant, publish_queues
from bus.service import Runtime, serve
from bus.usage import UsageMeter, UsageReporter
from bus.watch import follow_kv
from schemas import subjects
from schemas.cachectl import CACHE_QUERY_DECODER, CacheQuery
from schemas.jobs import TERMINAL_STATUSES
from schemas.metrics import TenantQueue
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
from services.trainer.announce import Announcer
from services.trainer.checks import check_call
from services.trainer.commit import Committer
from services.trainer.config import TrainerConfig
from services.trainer.crashguard import CrashGuard, DeadLettered
from services.trainer.features import cache_stats, feature_sources
from services.trainer.featurestore import BucketFeatureStore
from services.trainer.intake import Intake, MissingPayload, Waiting
from services.trainer.jobs import JobSlot
from services.trainer.ledger import Verdict, sft_verdict
from services.trainer.registry import WAIT, JobRegistry
from services.trainer.scheduler import Candidate, drr_round
from services.trainer.slots import Slots
from services.trainer.steps import Stepper
from vla.backbone import Backbone

log = logging.getLogger(__name__)
#: At stop, applied work is committed (so it is acked) only within this long.
STOP_COMMIT_S = 1.5

__all__ = ["Trainer", "TrainerConfig", "run"]


class Trainer:
    """The trainer's loop; bus state (KV, object store) is the source of truth."""

    def __init__(self, rt: Runtime, config: TrainerConfig, backbone: Backbone) -> None:
        self.rt = rt
        self.consumer = rt.consumer
        self.config = config
        self.bid = backbone.backbone_id
        self.slots = Slots(backbone, int(config.memory_budget_mb * 2**20), config.device)
        self.registry = JobRegistry(rt.js, self.slots, config.keep_versions)
        self.announcer = Announcer(rt.js)
        self.emit = self.announcer.emit
        self.stepper = Stepper(self, backbone)
        #: What each tenant is charged: compute, samples, checkpoint bytes (USAGE).
        self.usage = UsageMeter()
        #: Time with work in hand: a step, an update or a commit (the heartbeat's active_s).
        self.active = BusyMeter()
        #: The backbone role's encoder, with ``--backbone-service`` (set by :func:`run`).
        self.remote: FeatureClient | None = None
        #: The feature cache's bucket tier, with ``--feature-store-mb`` (set by :func:`run`).
        self.store: BucketFeatureStore | None = None
        self.committer = Committer(
            self.registry,
            rt.consumer,
            self.emit,
            config.keep_versions,
            config.crash_after_commits,
            active=self.active,
            usage=self.usage,
        )
        self.tenants = DurableSet(
            rt.consumer,
            subjects.STREAM_TRAIN,
            f"{subjects.PREFIX}.train.{self.bid}.>",
            spec_for=self.spec_for,
            key_of=subjects.tenant_of,
            on_dead=self.announcer.tell_tenant,
        )
        self.guard = CrashGuard(rt.consumer)
        self.intake = Intake(
            rt.consumer,
            self.tenants,
            config.prefetch,
            config.limit,
            config.max_buffered,
            max_buffer_bytes=int(config.max_buffered_mb * (1 << 20)),
        )
        self.deficits: dict[str, float] = {}
        #: Set when a job record changes (a new job may have opened a tenant's queue).
        self.job_changed = asyncio.Event()
        #: Rung (core NATS, :func:`schemas.subjects.train_wake`) when a session call is queued:
        #: an idle trainer takes it at once instead of at its next poll.
        self.rung = asyncio.Event()
        #: Session calls applied at triage (optim steps, saves, loads).
        self.inline_calls = 0

    def spec_for(self, tenant: str) -> ConsumerSpec:
        return ConsumerSpec(
            subjects.STREAM_TRAIN,
            subjects.trainer_durable(self.bid, tenant),
            subjects.train(self.bid, tenant),
            ack_wait_s=self.config.ack_wait_s,
            max_deliver=self.config.max_deliver,
            max_ack_pending=10_000,
        )

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        await self.registry.connect()
        doorbell = await self.rt.nc.subscribe(subjects.train_wake(self.bid), cb=self._ring)
        cache_ctl = await self.rt.nc.subscribe(subjects.cache_ctl(self.bid), cb=self._cache_ctl)
        self.rt.spawn(
            follow_kv(self.registry.jobs_kv, self.rt.stop, self.observe_job),
            "job status follower",
        )
        last_discovery = -1e9
        worked = False
        stopped_clean = False
        try:
            while not self.rt.stop.is_set():
                # A job that starts running (its OpenSlot is already in TRAIN: the master
                # publishes it first) wakes discovery at once; the period is the fallback.
                if (
                    self.job_changed.is_set()
                    or time.monotonic() - last_discovery > self.config.discover_every_s
                ):
                    self.job_changed.clear()
                    for tenant in await self.tenants.discover():
                        log.info(
                            "serving tenant %s on %s", tenant, subjects.train(self.bid, tenant)
                        )
                        self.intake.add_tenant(tenant)
                    last_discovery = time.monotonic()
                if not self.tenants.durables:
                    await self.idle(self.config.discover_every_s)
                    continue
                self.rung.clear()
                live = self.live()
                arrived = 0
                # The last round's compute topped the buffers up: with a batch in every live
                # tenant's buffer, another fetch would only add a broker round trip here.
                if not (worked and self.intake.stocked(live)):
                    # With a session open its calls ring the doorbell: nothing is gained by a
                    # fetch that lingers (one tenant's lingering fetch holds up every other's).
                    arrived = await self.intake.fill(live, linger=not self.sessions_open())
                worked = await self.round()
                await self.commit_due()
                if not arrived and not worked and not self.tenants.backlog_fetched:
                    # Nothing to fetch from: new tenants' messages show up at discovery.
                    await self.idle(0.05)
            stopped_clean = True
        finally:
            for sub in (doorbell, cache_ctl):
                with contextlib.suppress(NatsError):
                    await sub.unsubscribe()
            await self.stepper.announced()
            if stopped_clean:
                await self.committer.commit_applied(self.registry.jobs.values(), STOP_COMMIT_S)
            else:
                # Raised out of a round (a bug): its slots may be stepped with their batches
                # not booked, and a commit of one would apply that step twice on replay. As
                # at a crash, nothing more is committed; the commits in flight were frozen
                # between rounds and may land.
                log.warning("stopping on an error: applied steps are not committed (replayed)")
                await self.committer.drain(within_s=STOP_COMMIT_S)
            if self.store is not None:
                await self.store.drain(within_s=1.0)  # what is not written is computed again

    def observe_job(self, entry: KeyValue.Entry) -> None:
        self.registry.observe_job(entry)
        self.job_changed.set()

    async def _ring(self, _msg: Msg) -> None:
        self.rung.set()

    async def _cache_ctl(self, msg: Msg) -> None:
        """An operator's ``joynexus cache stats|clear`` (answered only on an inbox)."""
        if not msg.reply or not reply_allowed(msg.reply):
            return
        try:
            query = decode(CACHE_QUERY_DECODER, msg.data) if msg.data else CacheQuery()
        except DecodeError:
            return  # nothing to answer with: the requester times out
        stats = await cache_stats(self.rt.instance, self.bid, self.stepper.cache, self.store, query)
        with contextlib.suppress(NatsError):
            await msg.respond(encode(stats))

    def sessions_open(self) -> bool:
        return any(j.spec.session and j.live for j in self.registry.jobs.values())

    def live(self) -> set[str]:
        """Tenants with a live job: worth fetching from even when discovery saw nothing."""
        return {j.spec.tenant for j in self.registry.jobs.values() if j.live}

    async def idle(self, seconds: float) -> None:
        """Wait until a stop, a job change, a ring or ``seconds``, whichever comes first."""
        waits = [
            asyncio.ensure_future(e.wait()) for e in (self.rt.stop, self.job_changed, self.rung)
        ]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when="FIRST_COMPLETED")
        finally:
            # Event.wait() holds no nats call: cancelling it is safe (unlike PITFALLS' case).
            for fut in waits:
                fut.cancel()

    async def round(self) -> bool:
        """Triage every buffer; DRR picks the tenants served; one grouped step; RL updates.
        Returns whether anything was applied."""
        inline_before = self.inline_calls
        ready: dict[str, tuple[Msg, SFTBatch | ForwardBackward, JobSlot]] = {}
        for tenant in list(self.intake.buffers):
            picked = await self.triage(tenant)
            if picked is not None:
                ready[tenant] = picked
        # A CloseSlot triaged after its job's batch was picked removed the slot: that batch
        # stays buffered and is consumed unapplied next round.
        ready = {t: p for t, p in ready.items() if self.registry.jobs.get(p[2].key) is p[2]}
        # A step that was running when the process died before runs alone (crashguard.py).
        alone = await self.guard.suspect({t: [p[0]] for t, p in ready.items()})
        if alone is not None:
            ready = {alone: ready[alone]}
            # Alone: no commit of another job in flight either, to be blamed on it.
            await self.committer.drain()
        candidates = [
            Candidate(t, b.actions.shape[0], job.spec.priority, self.slots.footprint(job.key))
            for t, (_, b, job) in ready.items()
        ]
        drr = drr_round(self.deficits, candidates, self.config.quantum, self.slots.budget_bytes)
        self.deficits = drr.deficits
        chosen = [ready[t] for t in drr.chosen]
        for tenant in drr.chosen:
            self.intake.remove(tenant, ready[tenant][0])
        dead = await self.guard.begin(msg for msg, _, _ in chosen)
        for msg, _, job in chosen:
            if any(msg is d for d in dead):
                job.closed = True  # dead-lettered: its job fails; nothing more to apply
        chosen = [c for c in chosen if not any(c[0] is d for d in dead)]
        if chosen:
            # While the round computes (in a thread), top up the buffers (triage is done:
            # nothing else touches them until the next round), so the next round's batches
            # are there when this one ends.
            linger = not self.sessions_open()
            try:
                with self.active.busy():
                    await self.stepper.step(
                        chosen, during=lambda: self.intake.fill(self.live(), linger=linger)
                    )
            finally:
                await self.guard.returned(msg for msg, _, _ in chosen)
        complete = any(j.iteration_complete for j in self.registry.jobs.values())
        if complete:
            with self.active.busy():
                await self.stepper.rl_updates()
        return bool(chosen) or complete or self.inline_calls > inline_before

    async def triage(self, tenant: str) -> tuple[Msg, SFTBatch | ForwardBackward, JobSlot] | None:
        """Settle what needs no training (control, poison, already consumed), hold RL episodes
        of the current iteration, and return the first batch that is its job's next step.
        Messages that must wait (a later step, a slot whose OpenSlot is being redelivered)
        stay buffered, marked WAIT."""
        ready: tuple[Msg, SFTBatch | ForwardBackward, JobSlot] | None = None
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
                await self.consumed(msg, job)
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
            await self.consumed(msg, job)
        return verdict

    async def consumed(self, msg: Msg, job: JobSlot) -> None:
        """Settle a message its job's committed version already holds; while that version's
        event is owed (a restored job), once the event is out: the replay is what brings a
        restarted trainer back to a job, and acking it first could lose the event for good
        if this trainer stopped again before publishing it."""
        if job.unannounced is not None:
            job.awaiting_event.append((msg, None))
        else:
            await self.consumer.settle(msg, None)

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
                check_call(call, self.config.limit)
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
            await self.consumed(msg, job)
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
                await self.consumed(msg, existing)
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

    async def commit_due(self) -> None:
        """Start the commits that are due; they run in the background (off the critical
        path), one per job at a time. A commit covering a message that was in flight when
        the process died before (a suspect: the commit may be what killed it) runs alone:
        after the commits in flight, awaited, with no step running beside it to be blamed."""
        for job in list(self.registry.jobs.values()):
            if not job.commit_due(self.config.commit_every_s) or self.committer.busy(job):
                continue
            if await self.committer.covers_suspect(job):
                await self.committer.commit(job)  # alone (it drains the others first)
            else:
                self.committer.start(job)

    def queue(self) -> list[TenantQueue]:
        """Training messages buffered here, per tenant, and how long the oldest waited since
        it was published."""
        return per_tenant(
            (
                (tenant, msg.metadata.timestamp.timestamp())
                for tenant, buffered in self.intake.buffers.items()
                for msg, _ in buffered
            ),
            time.time(),
        )

    def gauges(self) -> dict[str, float]:
        return {
            "tenants": float(len(self.tenants.durables)),
            "fetches": float(self.tenants.fetches),
            "jobs": float(len(self.registry.jobs)),
            "resident_slot_bytes": float(self.slots.resident_bytes),
            "buffered_messages": float(sum(map(len, self.intake.buffers.values()))),
            "buffered_bytes": float(sum(map(self.intake.buffered_bytes, self.intake.buffers))),
            "commits": float(self.committer.commits),
            "commit_blocking_s": self.committer.blocking_s,
            "commit_s": self.committer.commit_s,
            "active_s": self.active.busy_s,
            **self.stepper.gauges(),
            **(self.remote.gauges() if self.remote is not None else {}),
            **(self.store.stats() if self.store is not None else {}),
        }


async def run(config: TrainerConfig) -> None:
    """Entry point: serve the trainer until SIGTERM/SIGINT."""

    async def body(rt: Runtime) -> None:
        torch.set_num_threads(config.torch_threads)
        if config.deterministic:
            torch.use_deterministic_algorithms(True)
        backbone = await rt.slow(
            Backbone.load,
            config.backbone,
            dtype=config.dtype,
            device=config.device,
            backbone_id=config.backbone_id,
        )
        trainer = Trainer(rt, config, backbone)
        sources = await feature_sources(rt, config, backbone)
        trainer.stepper.encoder = sources.encoder
        trainer.stepper.rl_encoder = sources.rl_encoder
        trainer.stepper.cache = sources.cache
        trainer.remote, trainer.store = sources.remote, sources.store
        rt.gauges = trainer.gauges
        # Steps and updates applied (messages settle only at commits).
        rt.progress = lambda: trainer.stepper.sft_fit.n + trainer.stepper.rl_fit.n
        rt.spawn(
            publish_queues(rt.nc, rt.stop, "trainer", rt.instance, "train", trainer.queue),
            "queue report",
        )
        usage = UsageReporter(
            rt.js,
            "trainer",
            rt.instance,
            trainer.usage,
            lambda: trainer.stepper.compute_s,
            config.usage_report_s,
        )
        rt.spawn(usage.loop(rt.stop), "usage report")
        async with placed(rt, backbone):
            await trainer.run()
        await usage.report(timeout=1.0)  # what the last rounds and commits charged

    await serve("trainer", config, body)
