"""Inferencer: the Inference Model Service.

One process holds the frozen backbone and the tenants' committed policies (synced from the
``policies`` KV and ``checkpoints`` store by :class:`~services.inferencer.policies.PolicyCache`).
It pulls the Inference Queue ``nexus.infer.<backbone>.>`` through ONE durable consumer
``inferencer-<backbone>`` that every replica shares (scale-out = start more replicas), bound
and settled by the service's consume runtime (:class:`bus.consume.Consumer`).

Scheduler (DESIGN.md §3): admitted requests are held (kept alive with in-progress acks) in a
FIFO until their observations reach ``target_batch`` B or the oldest has waited
``max_wait_ms`` T, whichever first; then ONE grouped backbone forward per compatibility key
runs in a worker thread (the loop keeps pulling and admitting meanwhile), each request's head
acts, the reply goes to its ``reply_to`` inbox (core NATS) and only then is the message
acked. A request's latency is bounded by T plus the forward in progress plus its own.

A request that can never be served (malformed, unknown job, version not stored, image or
proprio shapes that do not fit the policy) is dead-lettered by the runtime, whose ``on_dead``
hook answers it with ``error`` set and reports it on the job's ``EVENTS``; a request that
failed for a retryable reason gets no reply until its last delivery. The service goes on
serving everyone else. A request whose policy is loading waits for the load without taking a
place in the pull room; all jobs may have :data:`LOAD_WAITERS_PER_PLACE` waiters per place,
of which the last :data:`LOAD_WAITERS_KEPT_PER_PLACE` are kept for other jobs (each job
taking at most half of those left), and a request past either bound is retried after
:data:`LOAD_BUSY_DELAY_S` (at its last delivery answered "ask again", retryable, and acked:
a flood fills neither the dead letters nor the job's events), so one job's flood at a slow
load leaves the room, and places to wait, to the others.

Stop (the runtime's stop event, never a cancel): the model load gives up at once; the fetch
loop, the scheduler and the policies watch return; the batch in progress is answered if its
forward ends within :data:`BATCH_GRACE_S`, else handed back; admitted but unstarted requests
are handed back (nak) for another replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque

import numpy as np
import torch
from nats.aio.msg import Msg
from opentelemetry import trace

from bus import tracing
from bus.durable import ConsumerSpec, Durable
from bus.encoding import FeatureClient
from bus.errors import Interrupted, PoisonError, RetryableError
from bus.fate import HOLD, Fate, Hold
from bus.metering import BusyMeter, LinearFit
from bus.placement import placed
from bus.queues import per_tenant, publish_queues
from bus.service import Runtime, in_daemon_thread, serve
from bus.usage import UsageMeter, UsageReporter
from schemas import subjects
from schemas.infer import ActReply, ActRequest
from schemas.metrics import TenantQueue
from schemas.trace import AttributeValue
from services.inferencer.admission import expired, parse, validate
from services.inferencer.batching import BatchRunner, BatchStats, Outcome, Work
from services.inferencer.config import InferencerConfig
from services.inferencer.fairness import Waiting, fair_take
from services.inferencer.policies import (
    STOP_POLL_S,
    PolicyCache,
    ServedPolicy,
    retrieve_outcome,
    wait_bounded,
)
from services.inferencer.replies import Pending, Replies
from vla import costmodel
from vla.backbone import Backbone
from vla.costmodel import CostTable
from vla.wire import WireEncoder

log = logging.getLogger(__name__)

#: How long one pull waits for messages; also bounds how late the fetch loop sees a stop.
FETCH_TIMEOUT_S = 0.5
#: On stop, how long the batch in progress may still take to be answered; a forward that
#: has not ended by then is abandoned and its requests handed back.
BATCH_GRACE_S = 1.0
#: On stop, bounds on waiting for admissions (which give up on stop at their next wait),
#: for answers of earlier batches being settled, and for policy loads.
ADMIT_GRACE_S = 0.5
SETTLE_GRACE_S = 0.5
LOAD_GRACE_S = 0.5
#: Admissions that may wait on a policy load (a read or a checkpoint) beyond the pull room,
#: per place in it: a job whose policy loads slowly holds these, not the room other jobs'
#: requests are pulled through.
LOAD_WAITERS_PER_PLACE = 4
#: Of those, this many per place are kept for other jobs, each job taking at most half of
#: those left: a job flooding requests at a policy that loads slowly takes the others but
#: not these (and without any bound it would take every place: then nothing more would be
#: pulled, and the other jobs' requests would wait for its load too).
LOAD_WAITERS_KEPT_PER_PLACE = 1
#: A request turned away because the places to wait for loads are taken comes back this
#: much later (and is answered "ask again" at its last delivery).
LOAD_BUSY_DELAY_S = 1.0


class LoadBusy(RetryableError):
    """The request's policy is not loaded here and the places to wait for loads are taken
    (to it): it comes back later; at its last delivery it is answered "ask again"
    (retryable)."""


class Inferencer:
    """The inferencer's fetch loop, admission and (B, T) scheduler; its answers go through
    :class:`~services.inferencer.replies.Replies`."""

    def __init__(
        self,
        rt: Runtime,
        config: InferencerConfig,
        backbone: Backbone,
        costs: CostTable | None = None,
        remote: FeatureClient | None = None,
    ) -> None:
        self.rt = rt
        self.config = config
        self.remote = remote
        self.bid = backbone.backbone_id
        self.spec = ConsumerSpec(
            subjects.STREAM_INFER,
            f"inferencer-{self.bid}",
            f"{subjects.PREFIX}.infer.{self.bid}.>",
            ack_wait_s=config.ack_wait_s,
            max_deliver=config.max_deliver,
            max_ack_pending=10_000,
        )
        self.policies = PolicyCache(
            rt.js,
            config.device,
            config.max_versions_per_job,
            rt.stop,
            config.checkpoint_read_s,
            config.max_resident_jobs,
        )
        wire = (
            None
            if remote is None
            else WireEncoder(remote.request_sync, backbone.feature_layer, config.device)
        )
        self.runner = BatchRunner(backbone, costs, wire)
        self.pending: deque[Pending] = deque()
        self.pending_obs = 0
        #: Each waiting job's credit in the batches' deficit round robin (fairness.py).
        self.credit: dict[str, float] = {}
        self.admitting: set[asyncio.Task[Fate]] = set()
        self.settling: set[asyncio.Task[None]] = set()
        # Cap on unstarted requests held here: enough to fill the next batch while one runs,
        # few enough that other replicas get the rest of the queue.
        self.max_pending = 2 * config.target_batch
        #: Admissions under way in all, and those of them waiting on their policy.
        self.max_admitting = self.max_pending * (1 + LOAD_WAITERS_PER_PLACE)
        #: Of those, how many may wait on policy loads, and how many of these places are
        #: kept for other jobs (each job taking at most half of those left).
        self.max_waiting = self.max_pending * LOAD_WAITERS_PER_PLACE
        self.kept_for_others = self.max_pending * LOAD_WAITERS_KEPT_PER_PLACE
        self.resolving = 0
        #: Admissions waiting on their policy's load, per (tenant, job).
        self.resolving_per_job: Counter[tuple[str, str]] = Counter()
        self._wake = asyncio.Event()  # scheduler: something arrived (or stop)
        self._room = asyncio.Event()  # fetcher: the scheduler took requests (or stop)
        self.durable: Durable
        self.replies = Replies(rt)
        # gauges
        #: Requests dropped unanswered because their requester stopped waiting.
        self.expired = 0
        #: Requests turned away (to come back later) because the places to wait for loads
        #: were taken (to them).
        self.load_busy = 0
        self.forwards = 0
        self.batches = 0
        self.batch_s = 0.0
        #: A batch's forward time against its observations (the simulator's act cost).
        self.batch_fit = LinearFit()
        #: Time with at least one request admitted and not yet answered or handed back.
        self.active = BusyMeter()
        #: What each tenant is charged: batch compute, act requests, observations (USAGE).
        self.usage = UsageMeter()

    @property
    def name(self) -> str:
        return self.spec.durable

    # -- set-up ------------------------------------------------------------------------------
    async def open(self) -> None:
        """Open the policy stores and bind the shared durable (created on first start)."""
        await self.policies.open()
        self.durable = await self.rt.consumer.bind(self.spec, on_dead=self.replies.on_dead)

    # -- the loops ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve until the service stops, then hand back what was not started."""
        self.rt.spawn(self._wake_on_stop(), "inferencer waker")
        self.rt.spawn(self.policies.follow(), "policies follower")
        self.rt.spawn(self.fetch_loop(), "inferencer fetch")
        try:
            await self.schedule()
        finally:
            self.rt.stop.set()  # also when schedule() crashed: everything else winds down
            await self.drain()

    async def _wake_on_stop(self) -> None:
        await self.rt.stop.wait()
        self._wake.set()
        self._room.set()

    async def drain(self) -> None:
        """After the scheduler returned (the batch in progress is answered or handed back):
        let admissions see the stop, hand back every admitted, unstarted request, let the
        answers of earlier batches settle and loads end, each wait bounded."""
        await wait_bounded(self.admitting, ADMIT_GRACE_S, "admissions")
        unstarted = [p.msg for p in self.pending]
        self._leave(len(self.pending))
        self.pending.clear()
        self.pending_obs = 0
        if unstarted:
            log.info("handing back %d unstarted requests", len(unstarted))
            await self.rt.consumer.hand_back(unstarted)
        await wait_bounded(self.settling, SETTLE_GRACE_S, "answers")
        await self.policies.close(LOAD_GRACE_S)

    async def fetch_loop(self) -> None:
        """Pull while there is room; each message is admitted in its own task so one slow
        policy load does not hold up the others. A suspect (in flight when a process died
        before: :mod:`bus.crashes`) is served alone, with nothing else fetched, admitted or
        batched until it is answered, and counted only then: a request that kills the
        process (an out-of-memory forward, a crash in a kernel) then dies alone, and the
        requests that shared its batch are answered instead of dead-lettered beside it.
        Its policy is loaded first, one suspect at a time, uncounted, while the pulls go on
        (:meth:`_warm`): after a restart every policy is cold, and a suspect's load would
        otherwise hold up every other job's requests on this replica for as long as it
        takes (up to ``--checkpoint-read-s``)."""
        consumer = self.rt.consumer
        suspects: list[Msg] = []
        warming: tuple[Msg, asyncio.Task[None]] | None = None  # a suspect's policy loading
        loaded: Msg | None = None  # a suspect whose policy is loaded: next to run alone
        alone = False  # a suspect's handling is under way
        try:
            while not self.rt.stop.is_set():
                if warming is None and loaded is None and not alone and suspects:
                    suspect = suspects.pop(0)
                    cold = self._cold(suspect)
                    if cold is None:
                        loaded = suspect
                    else:
                        warm = asyncio.create_task(self._warm(suspect, cold))
                        warm.add_done_callback(lambda _: self._room.set())
                        warming = (suspect, warm)
                if warming is not None and warming[1].done():
                    suspect, warm = warming
                    warming = None
                    if not warm.cancelled() and warm.exception() is not None:
                        # Its load is done inside its run alone instead.
                        log.warning("loading a suspect's policy failed: %r", warm.exception())
                    loaded = suspect
                if loaded is not None or alone:
                    if self.admitting or self.active.running:
                        await self._wait_room()
                        continue
                    alone = False
                    if loaded is not None:
                        suspect, loaded = loaded, None
                        if await consumer.begin_redelivered(self.durable, suspect):
                            self._start_admission(suspect)
                            alone = True
                    continue
                # An admission waiting on its policy's load takes no place in the room (one
                # job's slow load must not stop the pulls of every other job), only one of
                # the bounded places beyond it.
                held = len(self.pending) + len(self.admitting) - self.resolving
                room = min(self.max_pending - held, self.max_admitting - len(self.admitting))
                if room <= 0:
                    await self._wait_room()
                    continue
                msgs = await consumer.fetch(
                    self.durable, room, FETCH_TIMEOUT_S, count_crashes=False
                )
                ready, found = await consumer.sort_out(self.durable, msgs)
                suspects += found
                for i, msg in enumerate(ready):
                    if self.rt.stop.is_set():
                        await consumer.hand_back(ready[i:])  # another replica serves them
                        break
                    self._start_admission(msg)
        finally:
            if warming is not None:
                # Not cancelled: its load gives up once stopping (Interrupted), and its mark
                # is cleared when it returns.
                await asyncio.wait({warming[1]}, timeout=LOAD_GRACE_S)
                suspects.append(warming[0])
            if loaded is not None:
                suspects.append(loaded)
            if suspects:
                await consumer.hand_back(suspects)

    def _cold(self, suspect: Msg) -> tuple[str, str, int] | None:
        """The policy (tenant, job, version) ``suspect`` asks for, if it must be loaded
        before the suspect runs alone; None if it is resident, or the suspect is malformed
        or expired (its admission settles it at once)."""
        try:
            request = parse(suspect, self.config.limit)
        except PoisonError:
            return None
        policy = (request.tenant, request.job_id, request.policy_version)
        if expired(request) or self.policies.resident(*policy) is not None:
            return None
        return policy

    async def _warm(self, suspect: Msg, policy: tuple[str, str, int]) -> None:
        """Load ``policy``, which ``suspect`` asks for, while other requests are served. The
        suspect is not counted for it (a crash of another request meanwhile must not climb
        its count), but the load is marked in the crash ledger (:mod:`bus.crashes`): a load
        that never returned (it killed the process: a checkpoint too large for memory) is
        not tried beside others again, and the suspect loads it inside its counted run
        alone. What the load raises is left to the suspect's own admission, which resolves
        the policy again and settles it."""
        ledger = self.rt.consumer.crashes
        if not await ledger.begin_preparing(suspect):
            return
        try:
            await self.policies.resolve(*policy)
        except Interrupted:
            pass  # stopping: the suspect is handed back
        except Exception as exc:  # noqa: BLE001 - not its fate: its admission meets it again
            log.info("loading the policy of suspect %s/%s failed: %r", *policy[:2], exc)
        finally:
            await ledger.end_preparing(suspect)

    async def _wait_room(self) -> None:
        """Until requests leave (taken into a batch, answered, admitted) or a pull's time."""
        self._room.clear()
        try:
            await asyncio.wait_for(self._room.wait(), FETCH_TIMEOUT_S)
        except TimeoutError:
            pass

    def _start_admission(self, msg: Msg) -> None:
        task = asyncio.create_task(self.rt.consumer.process(msg, self.admit))
        self.admitting.add(task)
        task.add_done_callback(self._admitted)

    def _admitted(self, task: asyncio.Task[Fate]) -> None:
        self.admitting.discard(task)
        self._room.set()
        error = None if task.cancelled() else task.exception()
        if error is not None:  # settling failed (the bus): the message is redelivered
            log.warning("settling an admission failed: %r", error)

    async def admit(self, msg: Msg) -> Hold | None:
        """Decode, resolve the policy, validate; queue the request, held until answered
        (None: acked at once, for a request whose requester stopped waiting). Errors are the
        runtime's to settle (poison: dead-lettered, then :meth:`on_dead` answers);
        :class:`Interrupted` once stopping, so the request is handed back."""
        arrived = asyncio.get_running_loop().time()
        request = parse(msg, self.config.limit)
        tracing.tag_job(request.tenant, request.job_id)
        if expired(request):
            self.expired += 1  # nobody waits for it: acked, unanswered, no forward spent
            return None
        try:
            policy = await self._resolve_in_time(request)
        except LoadBusy as busy:
            if not self.rt.consumer.is_last_delivery(msg, busy):
                raise  # back in a second: the load may have ended by then
            # Turned away, not failed: answered "ask again" and acked (no dead letter, no
            # error event on the job for each request of a flood).
            answer = ActReply(request.request_id, 0, error=str(busy), retryable=True)
            await self.replies.reply(request.reply_to, answer)
            return None
        if policy is None:
            self.expired += 1  # its policy loaded after the requester gave up: acked
            return None
        validate(request, policy, self.config.limit)
        if self.rt.stop.is_set():
            raise Interrupted()
        n = len(request.observations)
        span = trace.get_current_span().get_span_context()
        self.active.start()  # stopped by _leave() when it is answered or handed back
        self.pending.append(Pending(msg, Work(request, policy), n, arrived, span))
        self.pending_obs += n
        self._wake.set()
        return HOLD

    async def _resolve_in_time(self, request: ActRequest) -> ServedPolicy | None:
        """The request's policy, or None once its requester has stopped waiting: a load
        that outlasts it (a slow checkpoint read) is left to finish for later requests."""
        resident = self.policies.resident(request.tenant, request.job_id, request.policy_version)
        if resident is not None:
            return resident  # the common case: no wait, its place in the room kept
        job = (request.tenant, request.job_id)
        free = self.max_waiting - self.resolving
        waiting = self.resolving_per_job[job]
        busy = ""
        if free <= 0:
            busy = f"{self.resolving} requests already wait for policy loads here, the most"
        elif free <= self.kept_for_others and waiting >= max(1, free // 2):
            # The last places are kept for other jobs' loads, each job taking at most half
            # of those left (while more are free, a large job's cold start may use them):
            # neither one flood nor two take them all.
            busy = (
                f"{waiting} of its requests already wait for it here, and the places left "
                "are kept for other jobs"
            )
        if busy:
            self.load_busy += 1
            raise LoadBusy(
                f"the policy of {request.tenant}/{request.job_id} is not loaded here and "
                f"{busy}; ask again shortly",
                delay_s=LOAD_BUSY_DELAY_S,
            )
        resolving = asyncio.ensure_future(
            self.policies.resolve(request.tenant, request.job_id, request.policy_version)
        )
        resolving.add_done_callback(retrieve_outcome)
        self.resolving += 1
        self.resolving_per_job[job] += 1
        self._room.set()  # its place in the pull room is free while it waits
        try:
            while not resolving.done():
                left = request.expires_at - time.time() if request.expires_at > 0 else None
                if left is not None and left <= 0:
                    return None
                await asyncio.wait({resolving}, timeout=left)
        finally:
            self.resolving -= 1
            self.resolving_per_job[job] -= 1
            if not self.resolving_per_job[job]:
                del self.resolving_per_job[job]
        return resolving.result()

    async def schedule(self) -> None:
        """Dispatch a batch when B observations wait or the oldest waited T; until stop."""
        loop = asyncio.get_running_loop()
        target, wait_s = self.config.target_batch, self.config.max_wait_ms / 1000.0
        while not self.rt.stop.is_set():
            timeout: float | None = None
            if self.pending:
                oldest = min(p.arrived for p in self.pending)
                timeout = oldest + wait_s - loop.time()
                if self.pending_obs >= target or timeout <= 0:
                    await self.dispatch(self.take(target))
                    continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    def take(self, target: int) -> list[Pending]:
        """The next batch, up to ``target`` observations (at least one request): all that
        waits if it fits, else shared between jobs by weight (:func:`fair_take`)."""
        waiting = [
            Waiting(
                f"{p.work.request.tenant}/{p.work.request.job_id}",
                p.observations,
                p.work.request.priority,
            )
            for p in self.pending
        ]
        chosen = set(fair_take(waiting, target, self.credit))
        batch = [p for i, p in enumerate(self.pending) if i in chosen]
        self.pending = deque(p for i, p in enumerate(self.pending) if i not in chosen)
        self.pending_obs -= sum(p.observations for p in batch)
        self._room.set()
        return batch

    async def dispatch(self, batch: list[Pending]) -> None:
        """Run ``batch`` in a worker thread, then answer and settle every request. Stopping,
        the forward gets :data:`BATCH_GRACE_S` to end; else the batch is handed back.
        Requests whose requester stopped waiting meanwhile are acked unanswered first."""
        late = [p for p in batch if expired(p.work.request)]
        if late:
            self.expired += len(late)
            self._leave(len(late))
            batch = [p for p in batch if not expired(p.work.request)]
            await asyncio.gather(*(self.rt.consumer.settle(p.msg, None) for p in late))
            if not batch:
                return
        links = [trace.Link(p.span) for p in batch if p.span.is_valid]
        attributes: dict[str, AttributeValue] = {
            "messaging.system": "nats",
            "messaging.batch.message_count": len(batch),
            "joynexus.observations": sum(p.observations for p in batch),
            "joynexus.tenants": len({p.work.request.tenant for p in batch}),
        }
        with tracing.tracer().start_as_current_span(
            "inferencer batch", links=links, attributes=attributes
        ):
            forward = in_daemon_thread(
                lambda: self.runner.run([p.work for p in batch]), "inferencer-batch"
            )
            while not forward.done() and not self.rt.stop.is_set():
                await asyncio.wait({forward}, timeout=STOP_POLL_S)
            if not forward.done():
                await asyncio.wait({forward}, timeout=BATCH_GRACE_S)
        if not forward.done():
            log.warning("forward of %d requests still running at stop; handing back", len(batch))
            forward.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._leave(len(batch))
            await self.rt.consumer.hand_back((p.msg for p in batch), still_running=True)
            return
        try:
            outcomes, stats = forward.result()
        except Exception as exc:  # a bug of ours (logged): the runtime retries each request
            log.exception("batch of %d failed", len(batch))
            outcomes, stats = [Outcome(error=exc) for _ in batch], BatchStats()
        else:
            self.batches += 1
            self.batch_fit.add(stats.observations, stats.seconds)
        self.forwards += stats.forwards
        self.batch_s += stats.seconds
        shares: Counter[tuple[str, str]] = Counter()
        for p, outcome in zip(batch, outcomes, strict=True):
            request = p.work.request
            shares[(request.tenant, request.job_id)] += p.observations
            if outcome.error is None:
                self.usage.charge(
                    request.tenant, request.job_id, act_requests=1, observations=p.observations
                )
        self.usage.split(stats.seconds, shares)
        if self.rt.stop.is_set():
            await self.finish(batch, outcomes)  # answered before the stop goes on
            return
        # Settling awaits the bus (acks, dead letters): let the next batch start meanwhile.
        task = asyncio.create_task(self.finish(batch, outcomes))
        self.settling.add(task)
        task.add_done_callback(self.settling.discard)

    def _leave(self, requests: int) -> None:
        """``requests`` admitted requests are done here (answered, failed or handed back)."""
        for _ in range(requests):
            self.active.stop()
        self._room.set()

    async def finish(self, batch: list[Pending], outcomes: list[Outcome]) -> None:
        try:
            results = await asyncio.gather(
                *(self.replies.answer(p, o) for p, o in zip(batch, outcomes, strict=True)),
                return_exceptions=True,
            )
        finally:
            self._leave(len(batch))
        for pending, result in zip(batch, results, strict=True):
            if not isinstance(result, Exception):
                continue
            log.warning("answering %s failed: %r", pending.msg.subject, result)
            if self.rt.consumer.is_unsettled(pending.msg):
                # It failed before its settle: decided like any handler's error (retried,
                # dead-lettered and answered at the last delivery), never held for good.
                await self.rt.consumer.settle(pending.msg, result)

    # -- observability -----------------------------------------------------------------------
    def queue(self) -> list[TenantQueue]:
        """Requests admitted and waiting for a batch, per tenant."""
        now = asyncio.get_running_loop().time()
        return per_tenant(((p.work.request.tenant, p.arrived) for p in self.pending), now)

    def gauges(self) -> dict[str, float]:
        return {
            "requests_served": float(self.replies.served),
            "requests_failed": float(self.replies.failed),
            "requests_expired": float(self.expired),
            "requests_load_busy": float(self.load_busy),
            "observations_served": float(self.replies.observations),
            "forwards": float(self.forwards),
            "mean_group_size": self.replies.served / self.forwards if self.forwards else 0.0,
            "mean_batch_ms": 1000.0 * self.batch_s / self.batches if self.batches else 0.0,
            "pending": float(len(self.pending)),
            "busy_s": self.batch_s,
            "active_s": self.active.busy_s,
            "residence_s": self.replies.residence_s,
            **self.batch_fit.gauges("act_batch"),
            "target_batch": float(self.config.target_batch),
            "max_wait_ms": float(self.config.max_wait_ms),
            **self.policies.gauges(),
            **(self.remote.gauges() if self.remote is not None else {}),
        }


def load_backbone(config: InferencerConfig) -> Backbone:
    """Load the backbone and run one throwaway forward, so the first request does not pay
    for lazy initialisation. Blocking: the service runs it through ``Runtime.slow``."""
    backbone = Backbone.load(
        config.backbone, dtype=config.dtype, device=config.device, backbone_id=config.backbone_id
    )
    runner = BatchRunner(backbone)
    norm = runner.normaliser(1, 16)
    size = backbone.image_size
    inputs = norm.normalise_arrays(
        np.zeros((1, 1, size, size, 3), np.uint8), ["warm up"], np.zeros((1, 0), np.float32)
    )
    if config.backbone_service:
        backbone.release_weights()  # the backbone role encodes; this process holds heads
    else:
        backbone.encode(inputs)
    return backbone


async def serve_inferencer(rt: Runtime, config: InferencerConfig) -> None:
    """The service body: load the model (a stop meanwhile ends it at once), then serve."""
    backbone = await rt.slow(load_backbone, config)
    remote: FeatureClient | None = None
    costs: CostTable | None = None
    if config.backbone_service:  # the config refuses a cost table with it
        remote = FeatureClient(
            rt.nc,
            rt.js,
            asyncio.get_running_loop(),
            backbone.backbone_id,
            timeout_s=config.encode_timeout_s,
        )
    else:
        # Batches hold up to B observations: the table need not go further.
        costs = await rt.slow(
            costmodel.table_for,
            backbone,
            config.cost_table,
            max_samples=max(2, config.target_batch),
        )
    inferencer = Inferencer(rt, config, backbone, costs, remote)
    await inferencer.open()
    rt.gauges = inferencer.gauges
    rt.progress = lambda: inferencer.batches
    rt.spawn(
        publish_queues(rt.nc, rt.stop, "inferencer", rt.instance, "infer", inferencer.queue),
        "queue report",
    )
    usage = UsageReporter(
        rt.js,
        "inferencer",
        rt.instance,
        inferencer.usage,
        lambda: inferencer.batch_s,
        config.usage_report_s,
    )
    rt.spawn(usage.loop(rt.stop), "usage report")
    log.info(
        "serving %s (B=%d, T=%.1f ms)", inferencer.name, config.target_batch, config.max_wait_ms
    )
    async with placed(rt, backbone):
        await inferencer.run()
    await usage.report(timeout=1.0)  # what the last batches charged


async def run(config: InferencerConfig) -> None:
    """Entry point: serve the inferencer until SIGTERM/SIGINT."""
    torch.set_num_threads(config.torch_threads)

    async def body(rt: Runtime) -> None:
        await serve_inferencer(rt, config)

    await serve("inferencer", config, body)
