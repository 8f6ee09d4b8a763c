"""The inferencer's serving loop: pulls, admission, the (B, T) scheduler, batches.

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
place in the pull room, in one of a bounded number of places (:mod:`.loadwaits`); one past
the bounds is retried later (at its last delivery answered "ask again", retryable, and
acked: a flood fills neither the dead letters nor the job's events), so one job's flood at
a slow load leaves the room, and places to wait, to the others. Requests in flight when a
process died are served alone (:mod:`.suspects`).

Stop (the runtime's stop event, never a cancel): the fetch loop, the scheduler and the
policies watch return; the batch in progress is answered if its forward ends within
:data:`BATCH_GRACE_S`, else handed back; admitted but unstarted requests are handed back
(nak) for another replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque

from nats.aio.msg import Msg
from opentelemetry import trace

from bus import tracing
from bus.durable import ConsumerSpec, Durable
from bus.encoding import FeatureClient
from bus.errors import Interrupted
from bus.fate import HOLD, Fate, Hold
from bus.metering import BusyMeter, LinearFit
from bus.queues import per_tenant
from bus.service import Runtime, in_daemon_thread
from bus.usage import UsageMeter
from schemas import subjects
from schemas.infer import ActReply, ActRequest
from schemas.metrics import TenantQueue
from schemas.trace import AttributeValue
from services.inferencer.admission import expired, parse, validate
from services.inferencer.batching import BatchRunner, BatchStats, Outcome, Work
from services.inferencer.config import InferencerConfig
from services.inferencer.fairness import Waiting, fair_take
from services.inferencer.loadwaits import LoadBusy, LoadWaits
from services.inferencer.policies import (
    STOP_POLL_S,
    PolicyCache,
    ServedPolicy,
    retrieve_outcome,
    wait_bounded,
)
from services.inferencer.replies import Pending, Replies
from services.inferencer.suspects import Suspects
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
        #: Admissions under way in all: the room, and the places to wait for loads.
        self.load_waits = LoadWaits(self.max_pending)
        self.max_admitting = self.max_pending + self.load_waits.most
        self._wake = asyncio.Event()  # scheduler: something arrived (or stop)
        self._room = asyncio.Event()  # fetcher: the scheduler took requests (or stop)
        self.durable: Durable
        self.replies = Replies(rt)
        # gauges
        #: Requests dropped unanswered because their requester stopped waiting.
        self.expired = 0
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
        before) is served alone once its policy is loaded (:mod:`.suspects`): nothing else
        is pulled, admitted or batched until it is answered."""
        consumer = self.rt.consumer
        suspects = Suspects(consumer.crashes, self.policies, self.config.limit, self._room.set)
        try:
            while not self.rt.stop.is_set():
                suspects.advance()
                if suspects.exclusive:
                    if self.admitting or self.active.running:
                        await self._wait_room()
                        continue
                    suspect = suspects.next_alone()
                    if suspect is not None and await consumer.begin_redelivered(
                        self.durable, suspect
                    ):
                        self._start_admission(suspect)
                        suspects.running_alone()
                    continue
                # An admission waiting on its policy's load takes no place in the room (one
                # job's slow load must not stop the pulls of every other job), only one of
                # the bounded places beyond it.
                held = len(self.pending) + len(self.admitting) - self.load_waits.waiting
                room = min(self.max_pending - held, self.max_admitting - len(self.admitting))
                if room <= 0:
                    await self._wait_room()
                    continue
                msgs = await consumer.fetch(
                    self.durable, room, FETCH_TIMEOUT_S, count_crashes=False
                )
                ready, found = await consumer.sort_out(self.durable, msgs)
                suspects.add(found)
                for i, msg in enumerate(ready):
                    if self.rt.stop.is_set():
                        await consumer.hand_back(ready[i:])  # another replica serves them
                        break
                    self._start_admission(msg)
        finally:
            left = await suspects.close(LOAD_GRACE_S)
            if left:
                await consumer.hand_back(left)

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
        with self.load_waits.place(request.tenant, request.job_id):
            resolving = asyncio.ensure_future(
                self.policies.resolve(request.tenant, request.job_id, request.policy_version)
            )
            resolving.add_done_callback(retrieve_outcome)
            self._room.set()  # its place in the pull room is free while it waits
            while not resolving.done():
                left = request.expires_at - time.time() if request.expires_at > 0 else None
                if left is not None and left <= 0:
                    return None
                await asyncio.wait({resolving}, timeout=left)
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
            "requests_load_busy": float(self.load_waits.turned_away),
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
