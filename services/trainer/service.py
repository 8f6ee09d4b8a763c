"""Trainer: the Training Model Service.

One process holds the frozen backbone and many tenant slots. It consumes the Training Queue
through one durable pull consumer per (backbone, tenant) (:class:`bus.durables.DurableSet`,
discovered from the ``TRAIN`` stream's subjects). Each round, every tenant's buffer is
triaged (:mod:`~services.trainer.triage`: control messages, replays and poison are settled,
the next applicable batch found), deficit round robin picks the tenants served
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
from bus.metering import BusyMeter
from bus.placement import placed
from bus.queues import per_tenant, publish_queues
from bus.service import Runtime, serve
from bus.usage import UsageMeter, UsageReporter
from bus.watch import follow_kv
from schemas import subjects
from schemas.cachectl import CACHE_QUERY_DECODER, CacheQuery
from schemas.metrics import TenantQueue
from services.trainer.announce import Announcer
from services.trainer.commit import Committer
from services.trainer.config import TrainerConfig
from services.trainer.crashguard import CrashGuard
from services.trainer.features import cache_stats, feature_sources
from services.trainer.featurestore import BucketFeatureStore
from services.trainer.intake import Intake
from services.trainer.registry import JobRegistry
from services.trainer.scheduler import Candidate, drr_round
from services.trainer.slots import Slots
from services.trainer.steps import Stepper
from services.trainer.triage import Picked, Triage
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
        self.triage = Triage(
            rt.consumer,
            self.intake,
            self.registry,
            self.slots,
            self.guard,
            self.committer,
            self.stepper,
            config.limit,
        )

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
        inline_before = self.triage.inline_calls
        ready: dict[str, Picked] = {}
        for tenant in list(self.intake.buffers):
            picked = await self.triage.buffer(tenant)
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
        return bool(chosen) or complete or self.triage.inline_calls > inline_before

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
