"""Trainer: the Training Model Service.

One process holds the frozen backbone and many tenant slots. It consumes the Training Queue
through one durable pull consumer per (backbone, tenant), discovered from the ``TRAIN``
stream's subjects; a deficit-round-robin scheduler (by samples, weighted by priority, with a
per-tenant prefetch cap) picks at most one micro-batch per tenant per round, and the round's
batches go through ONE grouped backbone forward, then a step per tenant.

Commit protocol (exactly-once steps): checkpoint the slot into the ``checkpoints`` object
store → advance the ``policies`` KV entry with compare-and-set (it records the highest stream
sequence the checkpoint contains) → publish a ``policy`` event → ack the messages the
checkpoint covers. A crash anywhere replays unacked messages; on restart the slot is restored
from its latest checkpoint, and a redelivered message at or below the recorded sequence is
acked without being applied again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import FetchTimeoutError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from pydantic import Field

from bus import checkpoints as ckpt
from bus.codec import DecodeError, decode, encode
from bus.config import BusConfig
from bus.consume import settle
from bus.errors import PoisonError
from bus.publish import msg_id, publish
from bus.service import Runtime, placed, serve
from schemas import subjects
from schemas.events import ErrorEvent, Event, PolicyPublished, Progress, event_kind
from schemas.jobs import JOB_RECORD_DECODER, TERMINAL_STATUSES
from schemas.tensor import TensorError
from schemas.train import (
    POLICY_RECORD_DECODER,
    TRAIN_DECODER,
    CloseSlot,
    OpenSlot,
    PolicyRecord,
    RolloutBatch,
    SFTBatch,
    TrainMessage,
)
from services.trainer import rl
from services.trainer.jobs import JobSlot
from vla.backbone import Backbone
from vla.grouping import TrainRequest, group_train_step
from vla.normalize import Normaliser
from vla.slot import NonFiniteLossError, SlotManager, TenantSlot

log = logging.getLogger(__name__)
#: Most messages buffered per tenant, waiting ones included.
MAX_BUFFER = 256


class TrainerConfig(BusConfig):
    """Trainer settings."""

    backbone: str = Field("tiny", description="Checkpoint dir or tiny name to load.")
    backbone_id: str | None = Field(None, description="Subject id (default: derived).")
    device: str = Field("cpu", description="torch device.")
    dtype: str = Field("float32", description="Backbone dtype (bfloat16 on CUDA).")
    deterministic: bool = Field(False, description="torch deterministic algorithms.")
    memory_budget_mb: float = Field(1024.0, gt=0, description="Resident slot budget.")
    prefetch: int = Field(4, ge=1, description="Messages fetched ahead per tenant.")
    quantum: int = Field(8, ge=1, description="DRR quantum in samples per round.")
    commit_every_s: float = Field(10.0, gt=0, description="Commit at least this often.")
    keep_versions: int = Field(3, ge=1, description="Checkpoints kept per job.")
    ack_wait_s: float = Field(
        5.0, gt=1, description="Consumer ack wait; held messages get in-progress acks."
    )
    max_deliver: int = Field(10, ge=1, description="Deliveries before dead-lettering.")
    discover_every_s: float = Field(0.5, gt=0, description="New-tenant discovery period.")
    crash_after_commits: int = Field(
        0, ge=0, description="Fault injection: SIGKILL self after this many commits, before acking."
    )


@dataclass
class Pending:
    """A fetched message with its decoded body (or why it cannot be decoded)."""

    msg: Msg
    body: TrainMessage | None
    error: PoisonError | None = None

    @property
    def seq(self) -> int:
        return int(self.msg.metadata.sequence.stream)


class _Wait:
    """Marker: the message must wait in the buffer (see :meth:`Trainer.job_for`)."""


WAIT = _Wait()


@dataclass
class TenantQueue:
    """One tenant's pull consumer, prefetch buffer and DRR deficit."""

    tenant: str
    sub: JetStreamContext.PullSubscription
    buffer: list[Pending] = field(default_factory=list)
    deficit: float = 0.0
    #: Buffered batches that cannot be applied yet (waiting for an earlier step or a slot).
    waiting: int = 0


class Trainer:
    """The trainer's state and loop; bus state (KV, object store) is the source of truth."""

    def __init__(self, rt: Runtime, config: TrainerConfig, backbone: Backbone) -> None:
        self.rt = rt
        self.js = rt.js
        self.config = config
        self.backbone = backbone
        self.bid = backbone.backbone_id
        self.queues: dict[str, TenantQueue] = {}
        self.jobs: dict[str, JobSlot] = {}
        self.job_status: dict[str, str] = {}
        self.slots = SlotManager(int(config.memory_budget_mb * 2**20), device=config.device)
        self.normalisers: dict[tuple[int, int], Normaliser] = {}
        self.commits = 0
        self.compute_s = 0.0
        self.round_s = 0.0
        self.samples = 0
        self.policies: KeyValue
        self.jobs_kv: KeyValue
        self.store: ObjectStore

    # -- set-up ------------------------------------------------------------------------------
    async def open(self) -> None:
        self.policies = await self.js.key_value(subjects.KV_POLICIES)
        self.jobs_kv = await self.js.key_value(subjects.KV_JOBS)
        self.store = await self.js.object_store(subjects.OBJ_CHECKPOINTS)

    def durable(self, tenant: str) -> str:
        return f"trainer-{self.bid}-{tenant}"

    async def discover(self) -> None:
        """Bind a consumer for every tenant subject of this backbone that has messages."""
        try:
            info = await self.js.stream_info(
                subjects.STREAM_TRAIN, subjects_filter=f"{subjects.PREFIX}.train.{self.bid}.>"
            )
        except NotFoundError:
            return
        for subject in (info.state.subjects or {}).keys():
            tenant = subject.rsplit(".", 1)[-1]
            if tenant not in self.queues:
                await self.bind(tenant)

    async def bind(self, tenant: str) -> None:
        durable = self.durable(tenant)
        try:
            await self.js.consumer_info(subjects.STREAM_TRAIN, durable)
        except NotFoundError:
            await self.js.add_consumer(
                subjects.STREAM_TRAIN,
                ConsumerConfig(
                    durable_name=durable,
                    filter_subject=subjects.train(self.bid, tenant),
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.ALL,
                    ack_wait=self.config.ack_wait_s,
                    max_deliver=self.config.max_deliver,
                    max_ack_pending=10_000,
                ),
            )
        sub = await self.js.pull_subscribe_bind(durable, stream=subjects.STREAM_TRAIN)
        self.queues[tenant] = TenantQueue(tenant, sub)
        log.info("serving tenant %s on %s", tenant, subjects.train(self.bid, tenant))

    async def follow_job_status(self) -> None:
        """Mirror the ``jobs`` KV statuses (cancellations reach the trainer this way)."""
        watcher = await self.jobs_kv.watchall()
        try:
            async for entry in watcher:
                if entry is None or not entry.value:
                    continue
                with contextlib.suppress(DecodeError):
                    record = decode(JOB_RECORD_DECODER, entry.value)
                    self.job_status[f"{record.tenant}/{record.job_id}"] = record.status
        finally:
            await watcher.stop()

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        status_task = asyncio.create_task(self.follow_job_status())
        keepalive_task = asyncio.create_task(self.keep_alive())
        last_discovery = 0.0
        try:
            while not self.rt.stop.is_set():
                if time.monotonic() - last_discovery > self.config.discover_every_s:
                    await self.discover()
                    last_discovery = time.monotonic()
                if not self.queues:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.rt.stop.wait(), self.config.discover_every_s)
                    continue
                await self.fill()
                await self.round()
                await self.commit_due()
        finally:
            for task in (status_task, keepalive_task):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.release()

    async def fill(self) -> None:
        """Top up every tenant's prefetch buffer (fetches run concurrently). Only when no
        tenant has work buffered is it worth waiting for messages to arrive."""
        wait_s = 0.001 if any(q.buffer for q in self.queues.values()) else 0.05

        async def top_up(q: TenantQueue) -> None:
            # Batches waiting for an earlier step do not use up the prefetch: the earlier
            # step must still be fetched. MAX_BUFFER bounds memory all the same.
            want = min(
                self.config.prefetch - (len(q.buffer) - q.waiting), MAX_BUFFER - len(q.buffer)
            )
            if want <= 0:
                return
            try:
                msgs = await q.sub.fetch(want, timeout=wait_s)
            except (FetchTimeoutError, NatsTimeoutError, TimeoutError):
                return
            for msg in msgs:
                q.buffer.append(self.decode(msg))

        await asyncio.gather(*(top_up(q) for q in self.queues.values()))

    def decode(self, msg: Msg) -> Pending:
        try:
            body = decode(TRAIN_DECODER, msg.data)
        except DecodeError as exc:
            return Pending(msg, None, PoisonError(f"malformed training message: {exc}"))
        tenant = msg.subject.rsplit(".", 1)[-1]
        if body.tenant != tenant:
            return Pending(
                msg,
                None,
                PoisonError(f"message for tenant {body.tenant!r} on tenant {tenant!r}'s subject"),
            )
        return Pending(msg, body)

    async def round(self) -> None:
        """Apply control messages, pick one batch per tenant by DRR, run one grouped step."""
        chosen: list[tuple[TenantQueue, Pending, JobSlot]] = []
        for q in self.queues.values():
            picked = await self.head_batch(q)
            if picked is None:
                q.deficit = 0.0  # an idle tenant does not bank credit
                continue
            pending, job = picked
            assert isinstance(pending.body, SFTBatch)
            samples = pending.body.actions.shape[0]
            q.deficit += self.config.quantum * max(1, job.spec.priority)
            if q.deficit >= samples:
                q.deficit -= samples
                q.buffer.remove(pending)
                chosen.append((q, pending, job))
        if chosen:
            await self.step(chosen)
        if any(j.iteration_complete for j in self.jobs.values()):
            await self.rl_updates()
        elif not chosen and all(not q.buffer for q in self.queues.values()):
            await asyncio.sleep(0)  # fetch() already waited; stay responsive

    async def head_batch(self, q: TenantQueue) -> tuple[Pending, JobSlot] | None:
        """Settle what needs no training (control, poison, already-consumed) and return the
        first batch that is its job's next step, if any.

        A job's batches are applied strictly in ``step`` order. After a crash, batches that
        were never delivered arrive at once while the dead instance's unacked ones come back
        only after the ack wait, so a later step can be buffered before an earlier one: it
        waits in the buffer until the gap is filled.
        """
        ready: tuple[Pending, JobSlot] | None = None
        q.waiting = 0
        for pending in list(q.buffer):
            body = pending.body
            try:
                if pending.error is not None:
                    raise pending.error
                if isinstance(body, OpenSlot):
                    q.buffer.remove(pending)
                    await self.open_slot(pending, body)
                    continue
                if isinstance(body, CloseSlot):
                    q.buffer.remove(pending)
                    await self.close_slot(body)
                    await self.settle_ok(pending.msg)
                    continue
                if isinstance(body, RolloutBatch):
                    await self.collect_rollout(q, pending, body)
                    continue
                assert isinstance(body, SFTBatch)
                job = await self.job_for(body.tenant, body.job_id)
                if isinstance(job, _Wait):
                    q.waiting += 1  # its OpenSlot is being redelivered
                    continue
                if (
                    job is None
                    or job.closed
                    or pending.seq <= job.applied_seq
                    or body.step < job.batches_done
                ):
                    # Ended job, or already consumed (by sequence: replay after a crash; by
                    # step: a re-publish after the duplicate window): never apply twice.
                    q.buffer.remove(pending)
                    await self.settle_ok(pending.msg)
                    continue
                if body.step == job.batches_done and ready is None:
                    ready = (pending, job)
                else:
                    q.waiting += 1
            except PoisonError as exc:
                if pending in q.buffer:
                    q.buffer.remove(pending)
                await self.reject(pending, exc)
        return ready

    async def collect_rollout(self, q: TenantQueue, pending: Pending, body: RolloutBatch) -> None:
        """Hold an episode of its job's current iteration; later iterations wait, earlier or
        duplicate episodes are acked (already consumed)."""
        job = await self.job_for(body.tenant, body.job_id)
        if isinstance(job, _Wait):
            q.waiting += 1
            return
        if (
            job is None
            or job.closed
            or pending.seq <= job.applied_seq
            or body.iteration < job.batches_done
            or body.episode in job.rollouts
        ):
            q.buffer.remove(pending)
            await self.settle_ok(pending.msg)
            return
        if job.spec.rl is None:
            raise PoisonError(f"rollout records sent to supervised job {body.job_id!r}")
        if body.iteration > job.batches_done:
            q.waiting += 1
            return
        lag = job.slot.version - body.policy_version
        if lag > job.spec.rl.max_policy_lag or lag < 0:
            raise PoisonError(
                f"stale rollout: episode {body.episode} of iteration {body.iteration} was "
                f"collected with policy v{body.policy_version}, the job is at "
                f"v{job.slot.version} and accepts a lag of {job.spec.rl.max_policy_lag}"
            )
        q.buffer.remove(pending)
        job.rollouts[body.episode] = (pending.msg, body)

    async def rl_updates(self) -> None:
        """One PPO/GRPO update for every job whose iteration is complete."""
        ready = [j for j in self.jobs.values() if j.iteration_complete and not j.closed]
        if not ready:
            return
        slots = self.slots.acquire([j.key for j in ready])
        iterations = []
        for job, slot in zip(ready, slots, strict=True):
            job.slot = slot
            assert job.spec.rl is not None
            bodies = [job.rollouts[e][1] for e in sorted(job.rollouts)]
            iterations.append(
                rl.Iteration(job.key, slot, job.normaliser, job.spec.rl, bodies, slot.version)
            )
        t0 = time.perf_counter()
        results = await asyncio.to_thread(rl.update_iterations, self.backbone, iterations)
        self.compute_s += time.perf_counter() - t0
        events = []
        for job in ready:
            result = results[job.key]
            msgs = [m for m, _ in job.rollouts.values()]
            job.rollouts.clear()
            if isinstance(result, Exception):
                for msg in msgs:
                    await self.reject(
                        Pending(msg, None), PoisonError(f"RL update failed: {result}")
                    )
                continue
            job.applied_seq = max(job.applied_seq, *(m.metadata.sequence.stream for m in msgs))
            job.batches_done += 1
            job.held.extend(msgs)
            job.metrics = result
            self.samples += int(result.get("episode_length", 0) * result.get("episodes", 0))
            events.append(
                Progress(
                    job.spec.tenant,
                    job.spec.job_id,
                    job.batches_done,
                    job.spec.total_steps,
                    dict(result),
                    time.time(),
                )
            )
        await asyncio.gather(*(self.emit(ev, step_id=ev.step) for ev in events))

    # -- slots -------------------------------------------------------------------------------
    def normaliser(self, num_views: int, token_budget: int) -> Normaliser:
        key = (num_views, token_budget)
        if key not in self.normalisers:
            self.normalisers[key] = Normaliser(self.backbone, num_views, token_budget)
        return self.normalisers[key]

    async def status_of(self, tenant: str, job_id: str) -> str | None:
        """The job's status (mirror of the ``jobs`` KV, read through on a miss)."""
        key = f"{tenant}/{job_id}"
        if key not in self.job_status:
            try:
                entry = await self.jobs_kv.get(f"{tenant}.{job_id}")
            except KeyNotFoundError:
                return None
            if entry.value:
                self.job_status[key] = decode(JOB_RECORD_DECODER, entry.value).status
        return self.job_status.get(key)

    async def job_for(self, tenant: str, job_id: str) -> JobSlot | _Wait | None:
        """The job's slot: resident, or restored from its latest checkpoint; None if the job
        has ended; WAIT if the job is live but its slot's OpenSlot has not been applied yet
        (a redelivery in flight). Raises PoisonError for a job nobody submitted."""
        key = f"{tenant}/{job_id}"
        if key in self.jobs:
            return self.jobs[key]
        if self.job_status.get(key) in TERMINAL_STATUSES:
            return None
        record, revision = await self.policy_record(tenant, job_id)
        if record is None:
            status = await self.status_of(tenant, job_id)
            if status in ("accepted", "running"):
                return WAIT
            if status in TERMINAL_STATUSES:
                return None
            raise PoisonError(f"no slot is open for job {job_id!r} of tenant {tenant!r}")
        data = await ckpt.get_checkpoint(self.store, record.object_name, record.sha256)
        # Hand the bytes to the slot manager: get() restores (decodes) them once.
        self.slots.store[key] = data
        slot = self.slots.get(key)
        job = JobSlot(
            record.slot,
            slot,
            self.normaliser(record.slot.num_views, record.slot.token_budget),
            revision,
            applied_seq=record.stream_seq,
            committed_seq=record.stream_seq,
            committed_step=record.step,
            batches_done=record.batches_done,
            committed_batches=record.batches_done,
            versions=deque([record.object_name]),
            metrics=dict(record.metrics),
        )
        self.jobs[key] = job
        await ckpt.prune(self.store, tenant, job_id, slot.version - self.config.keep_versions + 1)
        log.info(
            "restored %s at step %d (v%d, seq %d)", key, slot.step, slot.version, record.stream_seq
        )
        return job

    async def policy_record(self, tenant: str, job_id: str) -> tuple[PolicyRecord | None, int]:
        try:
            entry = await self.policies.get(f"{tenant}.{job_id}")
        except KeyNotFoundError:
            return None, 0
        if not entry.value or entry.revision is None:
            return None, 0
        return decode(POLICY_RECORD_DECODER, entry.value), entry.revision

    async def open_slot(self, pending: Pending, spec: OpenSlot) -> None:
        key = f"{spec.tenant}/{spec.job_id}"
        existing = key in self.jobs or (await self.policy_record(spec.tenant, spec.job_id))[0]
        if not existing:
            try:
                slot = self.slots.create(
                    key, spec.head, spec.optimizer, self.backbone.hidden_size, seed=spec.seed
                )
            except (ValueError, MemoryError) as exc:
                raise PoisonError(f"cannot open slot: {exc}") from exc
            if spec.init_object:
                try:
                    source = await ckpt.get_checkpoint(
                        self.store, spec.init_object, spec.init_sha256
                    )
                except ckpt.CheckpointError as exc:
                    self.slots.remove(key)
                    raise PoisonError(f"cannot initialise the slot: {exc}") from exc
                slot.module.load_state_dict(TenantSlot.from_bytes(source).module.state_dict())
            job = JobSlot(
                spec,
                slot,
                self.normaliser(spec.num_views, spec.token_budget),
                0,
                applied_seq=pending.seq,
            )
            self.jobs[key] = job
            job.held.append(pending.msg)
            await self.commit(job, initial=True)
            log.info("opened slot %s (%s head, %d steps)", key, spec.head.kind, spec.total_steps)
        else:
            await self.settle_ok(pending.msg)

    async def close_slot(self, close: CloseSlot) -> None:
        key = f"{close.tenant}/{close.job_id}"
        job = self.jobs.pop(key, None)
        if job is not None:
            job.closed = True
            for msg in job.held:  # their effect is in the final checkpoint, or abandoned
                await self.settle_ok(msg)
            if key in self.slots:
                self.slots.remove(key)
            log.info("closed slot %s (%s)", key, close.reason)

    # -- training ----------------------------------------------------------------------------
    async def step(self, chosen: list[tuple[TenantQueue, Pending, JobSlot]]) -> None:
        t0 = time.perf_counter()
        requests: list[TrainRequest] = []
        accepted: list[tuple[TenantQueue, Pending, JobSlot]] = []
        slots = self.slots.acquire([job.key for _, _, job in chosen])
        for (q, pending, job), slot in zip(chosen, slots, strict=True):
            job.slot = slot
            assert isinstance(pending.body, SFTBatch)
            try:
                requests.append(self.build_request(job, pending.body))
                accepted.append((q, pending, job))
            except (ValueError, TensorError) as exc:
                await self.reject(pending, PoisonError(f"bad batch: {exc}"))
        if not requests:
            return
        compute_t0 = time.perf_counter()
        results = await asyncio.to_thread(group_train_step, self.backbone, requests)
        compute_s = time.perf_counter() - compute_t0
        self.compute_s += compute_s
        now = time.time()
        events: list[Event] = []
        for (_q, pending, job), request in zip(accepted, requests, strict=True):
            batch = pending.body
            assert isinstance(batch, SFTBatch)
            result = results[job.key]
            if isinstance(result, Exception):
                # A non-finite loss drops this batch only; anything else is a broken job.
                fatal = not isinstance(result, NonFiniteLossError)
                job.batches_done = max(job.batches_done, batch.step + 1)
                await self.reject(pending, PoisonError(f"step failed: {result}"), fatal=fatal)
                continue
            job.applied_seq = pending.seq
            job.batches_done = max(job.batches_done, batch.step + 1)
            job.held.append(pending.msg)
            samples = request.actions_B_C_A.shape[0]
            self.samples += samples
            job.metrics = {
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "lr": result.lr,
                "samples_per_s": samples / max(1e-9, time.perf_counter() - t0),
            }
            events.append(
                Progress(
                    job.spec.tenant,
                    job.spec.job_id,
                    result.step,
                    job.spec.total_steps,
                    dict(job.metrics),
                    now,
                )
            )
        await asyncio.gather(
            *(self.emit(ev, step_id=ev.step) for ev in events if isinstance(ev, Progress))
        )
        self.round_s += time.perf_counter() - t0

    def build_request(self, job: JobSlot, batch: SFTBatch) -> TrainRequest:
        images = batch.images.to_numpy()
        proprio = batch.proprio.to_numpy()
        actions = batch.actions.to_numpy()
        if images.ndim != 5 or len(batch.instructions) != images.shape[0]:
            raise ValueError(f"images {images.shape} vs {len(batch.instructions)} instructions")
        head = job.spec.head
        want = (images.shape[0], head.chunk_len, head.action_dim)
        if actions.shape != want or actions.dtype != np.float32:
            raise ValueError(
                f"actions: expected float32 {want}, got {actions.dtype} {actions.shape}"
            )
        if proprio.shape != (images.shape[0], head.proprio_dim):
            raise ValueError(
                f"proprio: expected {(images.shape[0], head.proprio_dim)}, got {proprio.shape}"
            )
        inputs = job.normaliser.normalise_arrays(
            images, batch.instructions, proprio.astype(np.float32)
        )
        return TrainRequest(job.key, job.slot, inputs, torch.from_numpy(actions.copy()))

    # -- commit protocol ---------------------------------------------------------------------
    async def commit_due(self) -> None:
        for job in list(self.jobs.values()):
            if job.commit_due(self.config.commit_every_s):
                await self.commit(job)

    async def commit(self, job: JobSlot, initial: bool = False) -> None:
        """Checkpoint → policies KV CAS → policy event → ack what the checkpoint covers."""
        slot = job.slot
        # Versions count from 1 (the initial weights): 0 means "none" / "latest" elsewhere.
        slot.publish_version()
        data = await asyncio.to_thread(slot.to_bytes)
        sha = ckpt.digest(data)
        name = ckpt.object_name(job.spec.tenant, job.spec.job_id, slot.version, sha)
        await ckpt.put_checkpoint(self.store, name, data)
        covered_seq = job.applied_seq
        record = PolicyRecord(
            job.spec.tenant,
            job.spec.job_id,
            slot.version,
            slot.step,
            name,
            sha,
            covered_seq,
            job.spec,
            time.time(),
            dict(job.metrics),
            job.batches_done,
        )
        key = f"{job.spec.tenant}.{job.spec.job_id}"
        if initial:
            job.kv_revision = await self.policies.create(key, encode(record))
        else:
            job.kv_revision = await self.policies.update(key, encode(record), last=job.kv_revision)
        job.committed_seq, job.committed_step = covered_seq, slot.step
        job.committed_batches = job.batches_done
        job.last_commit_at = time.monotonic()
        await self.emit(
            PolicyPublished(
                job.spec.tenant,
                job.spec.job_id,
                slot.version,
                name,
                slot.step,
                time.time(),
                final=job.finished,
            )
        )
        self.commits += 1
        if self.config.crash_after_commits and self.commits >= self.config.crash_after_commits:
            log.warning("fault injection: SIGKILL after commit %d, before its acks", self.commits)
            os.kill(os.getpid(), signal.SIGKILL)
        covered = [m for m in job.held if m.metadata.sequence.stream <= covered_seq]
        job.held = [m for m in job.held if m.metadata.sequence.stream > covered_seq]
        await asyncio.gather(*(self.settle_ok(m) for m in covered))
        job.versions.append(name)
        while len(job.versions) > self.config.keep_versions:
            with contextlib.suppress(NotFoundError):
                await self.store.delete(job.versions.popleft())

    # -- settling ----------------------------------------------------------------------------
    async def settle_ok(self, msg: Msg) -> None:
        await settle(
            self.js,
            msg,
            None,
            consumer=self.durable(msg.subject.rsplit(".", 1)[-1]),
            max_deliver=self.config.max_deliver,
        )

    async def reject(self, pending: Pending, error: PoisonError, fatal: bool = True) -> None:
        """Dead-letter a message and tell its tenant; ``fatal`` errors fail the job."""
        tenant = pending.msg.subject.rsplit(".", 1)[-1]
        job_id = getattr(pending.body, "job_id", None)

        async def tell(msg: Msg, reason: str, exc: BaseException) -> None:
            if job_id is not None:
                await self.emit(ErrorEvent(tenant, job_id, reason, False, fatal, time.time()))

        await settle(
            self.js,
            pending.msg,
            error,
            consumer=self.durable(tenant),
            max_deliver=self.config.max_deliver,
            on_dead=tell,
        )

    async def emit(self, event: Event, step_id: int | None = None) -> None:
        kind = event_kind(event)
        ident = step_id if step_id is not None else getattr(event, "version", event.at)
        await publish(
            self.js,
            subjects.event(event.tenant, event.job_id, kind),
            event,
            message_id=msg_id("ev", event.tenant, event.job_id, kind, ident),
        )

    async def keep_alive(self) -> None:
        """In-progress acks for held and buffered messages, so none is redelivered while
        waiting for its commit."""
        while True:
            await asyncio.sleep(self.config.ack_wait_s / 3)
            msgs = [m for j in self.jobs.values() for m in j.held]
            msgs += [m for j in self.jobs.values() for m, _ in j.rollouts.values()]
            msgs += [p.msg for q in self.queues.values() for p in q.buffer]
            for m in msgs:
                with contextlib.suppress(Exception):
                    await m.in_progress()

    async def release(self) -> None:
        """On stop: commit what was applied (so its messages are acked), hand back the rest."""
        for job in list(self.jobs.values()):
            if job.batches_done > job.committed_batches:
                with contextlib.suppress(Exception):
                    await self.commit(job)
        for q in self.queues.values():
            for pending in q.buffer:
                with contextlib.suppress(Exception):
                    await pending.msg.nak()
            q.buffer.clear()
            with contextlib.suppress(Exception):
                await q.sub.unsubscribe()

    def gauges(self) -> dict[str, float]:
        return {
            "tenants": float(len(self.queues)),
            "jobs": float(len(self.jobs)),
            "resident_slot_bytes": float(self.slots.resident_bytes),
            "samples": float(self.samples),
            "compute_s": self.compute_s,
            "round_s": self.round_s,
            "commits": float(self.commits),
        }


async def run(config: TrainerConfig) -> None:
    """Entry point: serve the trainer until SIGTERM/SIGINT."""
    torch.set_num_threads(config.torch_threads)
    if config.deterministic:
        torch.use_deterministic_algorithms(True)
    backbone = Backbone.load(
        config.backbone, dtype=config.dtype, device=config.device, backbone_id=config.backbone_id
    )

    async def body(rt: Runtime) -> None:
        trainer = Trainer(rt, config, backbone)
        await trainer.open()
        rt.in_flight = lambda: sum(len(j.held) for j in trainer.jobs.values())
        rt.gauges = trainer.gauges
        async with placed(rt, trainer.bid):
            await trainer.run()

    await serve("trainer", config, body)
