"""Inferencer: the Inference Model Service.

One process holds the frozen backbone and the tenants' committed policies (synced from the
``policies`` KV and ``checkpoints`` store by :class:`~services.inferencer.policies.PolicyCache`).
It pulls the Inference Queue ``nexus.infer.<backbone>.>`` through ONE durable consumer
``inferencer-<backbone>`` that every replica shares (scale-out = start more replicas).

Scheduler (DESIGN.md §3): admitted requests wait in a FIFO until their observations reach
``target_batch`` B or the oldest has waited ``max_wait_ms`` T, whichever first; then ONE
grouped backbone forward per compatibility key runs in a worker thread (the loop keeps
pulling and admitting meanwhile), each request's head acts, the reply goes to its
``reply_to`` inbox (core NATS) and only then is the message acked. A request's latency is
bounded by T plus the forward in progress plus its own.

A request that can never be served (malformed, unknown job, version not stored, image or
proprio shapes that do not fit the policy) is answered with ``error`` set and dead-lettered
through :func:`bus.consume.settle`; the service goes on serving everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError, FetchTimeoutError, NotFoundError
from pydantic import Field

from bus.codec import DecodeError, decode, encode
from bus.config import BusConfig
from bus.consume import error_reason, settle
from bus.errors import HandlerError, PoisonError
from bus.placement import placed
from bus.publish import msg_id, publish
from bus.service import Runtime, serve
from schemas import subjects
from schemas.events import ErrorEvent
from schemas.infer import INFER_DECODER, ActReply, ActRequest
from schemas.tensor import Tensor, TensorError
from services.inferencer.batching import REQUEST_ERRORS, BatchRunner, Outcome, Work
from services.inferencer.policies import PolicyCache, ServedPolicy
from vla.backbone import Backbone

log = logging.getLogger(__name__)

#: How long one pull waits for messages; also bounds how late a stop is noticed.
FETCH_TIMEOUT_S = 0.5
#: A subject we may publish to: dot-separated non-empty tokens, no whitespace or wildcards
#: (a malformed one would be a protocol error that costs us the connection).
_SUBJECT_RE = re.compile(r"^[^\s.*>]+(\.[^\s.*>]+)*$")


class InferencerConfig(BusConfig):
    """Inferencer settings (flags ``--target-batch 8`` or env ``JOYNEXUS_TARGET_BATCH=8``)."""

    backbone: str = Field("tiny", description="Checkpoint dir or tiny name to load.")
    backbone_id: str | None = Field(None, description="Subject id (default: derived).")
    device: str = Field("cpu", description="torch device.")
    dtype: str = Field("float32", description="Backbone dtype (bfloat16 on CUDA).")
    # Defaults measured on the tiny backbone, 1 torch thread, 2 shared CPU cores (see
    # services/bench_inference.py): a forward's cost per observation falls until ~16
    # (18 ms at 1, 5 ms at 8, 3.8 ms at 16, 4.7 ms at 32), and through the bus B=16 beat
    # B=8 (201 vs 145 req/s, p50 80 vs 108 ms with 16 sessions) and B=32 (158 vs 120 req/s
    # with 32). T=5 ms gathers most of a closed-loop round of 8 tenants (7 of 8 per forward,
    # 2x the per-request throughput) for at most 5 ms more latency when alone.
    target_batch: int = Field(
        16, ge=1, description="B: observations per grouped forward (dispatch when reached)."
    )
    max_wait_ms: float = Field(
        5.0, ge=0, description="T: dispatch when the oldest waiting request is this old."
    )
    max_versions_per_job: int = Field(
        3, ge=1, description="Resident policy versions per job (older ones serve pinned calls)."
    )
    ack_wait_s: float = Field(
        5.0, gt=0, description="Consumer ack wait: a dead replica's requests return this fast."
    )
    max_deliver: int = Field(3, ge=1, description="Deliveries before a request is dead.")


class _Envelope(msgspec.Struct):
    """What can be salvaged from an undecodable request to tell its sender why."""

    request_id: str = ""
    reply_to: str = ""


_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_Envelope)


@dataclass
class Pending:
    """An admitted request waiting for (or in) a batch."""

    msg: Msg
    work: Work
    observations: int
    #: Loop time when it was pulled: T counts from here.
    arrived: float


def validate(request: ActRequest, policy: ServedPolicy) -> None:
    """Raise :class:`PoisonError` naming the field if ``request`` cannot be served by
    ``policy``: no observations, num_views/token_budget other than the job's, an image that
    is not uint8 (H, W, 3), a proprio that is not float32 of the head's ``proprio_dim``."""
    spec, head = policy.spec, policy.head
    if not request.observations:
        raise PoisonError("request has no observations")
    if (request.num_views, request.token_budget) != (spec.num_views, spec.token_budget):
        raise PoisonError(
            f"request normalises with num_views={request.num_views}, "
            f"token_budget={request.token_budget} but {policy.label} was trained with "
            f"num_views={spec.num_views}, token_budget={spec.token_budget}"
        )
    for i, obs in enumerate(request.observations):
        if not 1 <= len(obs.images) <= spec.num_views:
            raise PoisonError(
                f"observations[{i}].images: expected 1 to {spec.num_views} views, "
                f"got {len(obs.images)}"
            )
        try:
            for v, image in enumerate(obs.images):
                image.validate()
                if image.dtype != "uint8" or len(image.shape) != 3 or image.shape[2] != 3:
                    raise PoisonError(
                        f"observations[{i}].images[{v}]: expected uint8 (H, W, 3), "
                        f"got {image.dtype} {tuple(image.shape)}"
                    )
                if image.shape[0] == 0 or image.shape[1] == 0:
                    raise PoisonError(f"observations[{i}].images[{v}]: empty image")
            obs.proprio.validate()
        except TensorError as exc:
            raise PoisonError(f"observations[{i}]: {exc}") from exc
        if obs.proprio.dtype != "float32" or tuple(obs.proprio.shape) != (head.proprio_dim,):
            raise PoisonError(
                f"observations[{i}].proprio: {policy.label}'s head expects float32 "
                f"({head.proprio_dim},), got {obs.proprio.dtype} {tuple(obs.proprio.shape)}"
            )


class Inferencer:
    """The inferencer's pull loop, admission, (B, T) scheduler and replies."""

    def __init__(self, rt: Runtime, config: InferencerConfig, backbone: Backbone) -> None:
        self.rt = rt
        self.js: JetStreamContext = rt.js
        self.config = config
        self.bid = backbone.backbone_id
        self.durable = f"inferencer-{self.bid}"
        self.policies = PolicyCache(rt.js, config.device, config.max_versions_per_job)
        self.runner = BatchRunner(backbone)
        self.pending: deque[Pending] = deque()
        self.pending_obs = 0
        self.running: list[Pending] = []
        self.admitting: set[asyncio.Task[None]] = set()
        self.settling: set[asyncio.Task[None]] = set()
        # Cap on unstarted requests held here: enough to fill the next batch while one runs,
        # few enough that other replicas get the rest of the queue.
        self.max_pending = 2 * config.target_batch
        self._wake = asyncio.Event()  # scheduler: something arrived (or stop)
        self._room = asyncio.Event()  # fetcher: the scheduler took requests (or stop)
        self.sub: JetStreamContext.PullSubscription
        # gauges
        self.served = 0
        self.failed = 0
        self.observations = 0
        self.forwards = 0
        self.batches = 0
        self.batch_s = 0.0

    # -- set-up ------------------------------------------------------------------------------
    async def open(self) -> None:
        await self.policies.open()
        self.sub = await self.bind()

    async def bind(self) -> JetStreamContext.PullSubscription:
        """Bind the shared durable consumer, creating it on first start."""
        try:
            await self.js.consumer_info(subjects.STREAM_INFER, self.durable)
        except NotFoundError:
            config = ConsumerConfig(
                durable_name=self.durable,
                filter_subject=f"{subjects.PREFIX}.infer.{self.bid}.>",
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=self.config.ack_wait_s,
                max_deliver=self.config.max_deliver,
                max_ack_pending=10_000,
            )
            try:
                await self.js.add_consumer(subjects.STREAM_INFER, config)
            except BadRequestError as exc:
                # A work-queue stream refuses overlapping filters, e.g. a consumer left by an
                # older layout on nexus.infer.>: say so instead of a bare API error.
                raise RuntimeError(
                    f"cannot create consumer {self.durable} on {subjects.STREAM_INFER} "
                    f"({exc.description}); remove consumers whose filter overlaps "
                    f"{config.filter_subject}"
                ) from exc
        return await self.js.pull_subscribe_bind(self.durable, stream=subjects.STREAM_INFER)

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        follow = asyncio.create_task(self.policies.follow())
        waker = asyncio.create_task(self._wake_on_stop())
        fetcher = asyncio.create_task(self.fetch_loop())
        try:
            await self.schedule()
        finally:
            # Stop: the batch in progress was answered by schedule(); pulled but unstarted
            # requests go back to the queue for another replica. (If schedule() crashed,
            # stopping here too lets the fetcher end, and serve() re-raises the crash.)
            self.rt.stop.set()
            await fetcher
            for task in list(self.admitting):
                task.cancel()
            await asyncio.gather(*self.admitting, return_exceptions=True)
            while self.pending:
                with contextlib.suppress(NatsError):
                    await self.pending.popleft().msg.nak()
            await asyncio.gather(*self.settling, return_exceptions=True)
            for task in (follow, waker):
                task.cancel()
            await asyncio.gather(follow, waker, return_exceptions=True)
            await self.policies.close()
            with contextlib.suppress(NatsError):
                await self.sub.unsubscribe()

    async def _wake_on_stop(self) -> None:
        await self.rt.stop.wait()
        self._wake.set()
        self._room.set()

    async def fetch_loop(self) -> None:
        """Pull while there is room; each message is admitted in its own task so one slow
        policy load does not hold up the others."""
        while not self.rt.stop.is_set():
            room = self.max_pending - len(self.pending) - len(self.admitting)
            if room <= 0:
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), FETCH_TIMEOUT_S)
                continue
            try:
                msgs = await self.sub.fetch(room, timeout=FETCH_TIMEOUT_S)
            except (TimeoutError, FetchTimeoutError, NatsTimeoutError):
                continue
            except NatsError as exc:  # broker restart: reconnects on its own; try again
                log.warning("fetch failed: %s", exc)
                await asyncio.sleep(0.2)
                continue
            for msg in msgs:
                if self.rt.stop.is_set():
                    with contextlib.suppress(NatsError):
                        await msg.nak()  # release: another replica serves it
                    continue
                task = asyncio.create_task(self.admit(msg))
                self.admitting.add(task)
                task.add_done_callback(self.admitting.discard)

    async def admit(self, msg: Msg) -> None:
        """Decode, resolve the policy, validate; queue the request or answer its error."""
        arrived = asyncio.get_running_loop().time()
        request: ActRequest | None = None
        try:
            try:
                request = decode(INFER_DECODER, msg.data)
            except DecodeError as exc:
                raise PoisonError(f"malformed act request: {exc}") from exc
            if not _SUBJECT_RE.fullmatch(request.reply_to):
                raise PoisonError(f"reply_to {request.reply_to!r} is not a subject to reply on")
            tenant = msg.subject.rsplit(".", 1)[-1]
            if request.tenant != tenant:
                raise PoisonError(
                    f"request for tenant {request.tenant!r} on tenant {tenant!r}'s subject"
                )
            policy = await self.policies.resolve(
                request.tenant, request.job_id, request.policy_version
            )
            validate(request, policy)
        except asyncio.CancelledError:
            with contextlib.suppress(NatsError):
                await msg.nak()
            raise
        except Exception as exc:  # noqa: BLE001 - fail() replies and settle() decides its fate
            await self.fail(msg, exc, request)
            return
        n = len(request.observations)
        self.pending.append(Pending(msg, Work(request, policy), n, arrived))
        self.pending_obs += n
        self._wake.set()

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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def take(self, target: int) -> list[Pending]:
        """The next batch: FIFO, up to ``target`` observations (at least one request)."""
        batch: list[Pending] = []
        total = 0
        while self.pending and (not batch or total + self.pending[0].observations <= target):
            p = self.pending.popleft()
            batch.append(p)
            total += p.observations
        self.pending_obs -= total
        self._room.set()
        return batch

    async def dispatch(self, batch: list[Pending]) -> None:
        """Run ``batch`` in the worker thread, then answer and settle every request."""
        self.running = batch
        try:
            outcomes, stats = await asyncio.to_thread(self.runner.run, [p.work for p in batch])
        except Exception as exc:  # a bug of ours (logged): settle() retries each request
            log.exception("batch of %d failed", len(batch))
            outcomes = [Outcome(error=exc) for _ in batch]
        else:
            self.forwards += stats.forwards
            self.batches += 1
            self.batch_s += stats.seconds
        finally:
            self.running = []
        # Settling awaits the bus (dead letters are JetStream publishes): let the next batch
        # start meanwhile.
        task = asyncio.create_task(self.finish(batch, outcomes))
        self.settling.add(task)
        task.add_done_callback(self.settling.discard)

    async def finish(self, batch: list[Pending], outcomes: list[Outcome]) -> None:
        await asyncio.gather(*(self.answer(p, o) for p, o in zip(batch, outcomes, strict=True)))

    # -- replies and fates -------------------------------------------------------------------
    async def answer(self, pending: Pending, outcome: Outcome) -> None:
        request = pending.work.request
        if outcome.error is not None:
            error: Exception = outcome.error
            if isinstance(error, REQUEST_ERRORS):
                error = PoisonError(f"bad observation for {pending.work.policy.label}: {error}")
            await self.fail(pending.msg, error, request, pending.work.policy.version)
            return
        assert outcome.actions_B_C_A is not None and outcome.log_prob_B is not None
        reply = ActReply(
            request.request_id,
            pending.work.policy.version,
            actions=Tensor.from_numpy(outcome.actions_B_C_A),
            log_probs=Tensor.from_numpy(outcome.log_prob_B),
            values=None if outcome.value_B is None else Tensor.from_numpy(outcome.value_B),
            group_size=outcome.group_size,
        )
        await self.reply(request.reply_to, reply)
        self.served += 1
        self.observations += pending.observations
        await settle(
            self.js, pending.msg, None, consumer=self.durable, max_deliver=self.config.max_deliver
        )

    async def reply(self, reply_to: str, reply: ActReply) -> None:
        if not _SUBJECT_RE.fullmatch(reply_to):
            return  # nobody to tell (the dead letter still records why)
        try:
            await self.rt.nc.publish(reply_to, encode(reply))
        except NatsError as exc:  # an invalid inbox must not stop the ack or the service
            log.warning("cannot reply to %r: %s", reply_to, exc)

    async def fail(
        self,
        msg: Msg,
        error: BaseException,
        request: ActRequest | None,
        policy_version: int = 0,
    ) -> None:
        """Answer the sender with the error when this is the message's last delivery, and
        let :func:`settle` retry or dead-letter it."""
        # Mirrors settle()'s decision: a retried request gets no reply yet (its next
        # delivery may succeed); a request that is dead gets one, so its sender is not left
        # waiting for a timeout.
        retryable = not isinstance(error, DecodeError) and (
            not isinstance(error, HandlerError) or error.retryable
        )
        final = not retryable or msg.metadata.num_delivered >= self.config.max_deliver
        if final:
            self.failed += 1
            envelope = request or self._envelope(msg)
            reply = ActReply(envelope.request_id, policy_version, error=error_reason(error))
            await self.reply(envelope.reply_to, reply)
        await settle(
            self.js,
            msg,
            error,
            consumer=self.durable,
            max_deliver=self.config.max_deliver,
            on_dead=self.tell_tenant,
        )

    @staticmethod
    def _envelope(msg: Msg) -> _Envelope:
        try:
            return _ENVELOPE_DECODER.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return _Envelope()

    async def tell_tenant(self, msg: Msg, reason: str, error: BaseException) -> None:
        """A dead request is also reported on the job's ``EVENTS`` subject (non-fatal)."""
        try:
            request = decode(INFER_DECODER, msg.data)
            subject = subjects.event(request.tenant, request.job_id, "error")
        except (DecodeError, ValueError):
            return  # no valid tenant/job to address: the dead letter is the record
        event = ErrorEvent(
            request.tenant,
            request.job_id,
            f"inference request {request.request_id}: {reason}",
            retryable=False,
            fatal=False,
            at=time.time(),
        )
        seq = msg.metadata.sequence.stream
        await publish(self.js, subject, event, message_id=msg_id("ev", "infer-dead", seq))

    # -- observability -----------------------------------------------------------------------
    def in_flight(self) -> int:
        return len(self.pending) + len(self.running) + len(self.admitting)

    def gauges(self) -> dict[str, float]:
        return {
            "requests_served": float(self.served),
            "requests_failed": float(self.failed),
            "observations_served": float(self.observations),
            "forwards": float(self.forwards),
            "mean_group_size": self.served / self.forwards if self.forwards else 0.0,
            "mean_batch_ms": 1000.0 * self.batch_s / self.batches if self.batches else 0.0,
            "pending": float(len(self.pending)),
            "target_batch": float(self.config.target_batch),
            "max_wait_ms": float(self.config.max_wait_ms),
            **self.policies.gauges(),
        }


async def run(config: InferencerConfig) -> None:
    """Entry point: serve the inferencer until SIGTERM/SIGINT."""
    torch.set_num_threads(config.torch_threads)
    backbone = Backbone.load(
        config.backbone, dtype=config.dtype, device=config.device, backbone_id=config.backbone_id
    )
    _warm_up(backbone)

    async def body(rt: Runtime) -> None:
        inferencer = Inferencer(rt, config, backbone)
        await inferencer.open()
        rt.in_flight = inferencer.in_flight
        rt.gauges = inferencer.gauges
        log.info(
            "serving %s (B=%d, T=%.1f ms)",
            inferencer.durable,
            config.target_batch,
            config.max_wait_ms,
        )
        async with placed(rt, backbone):
            await inferencer.run()

    await serve("inferencer", config, body)


def _warm_up(backbone: Backbone) -> None:
    """One throwaway forward, so the first request does not pay for lazy initialisation."""
    runner = BatchRunner(backbone)
    norm = runner.normaliser(1, 16)
    size = backbone.image_size
    inputs = norm.normalise_arrays(
        np.zeros((1, 1, size, size, 3), np.uint8), ["warm up"], np.zeros((1, 0), np.float32)
    )
    backbone.encode(inputs)
