"""Env workers: pull tasks from ``ENV``: dataset streams, RL rollouts and evaluations.

Offline half (SFT): a :class:`~schemas.env.StreamDataset` task streams a tenant's dataset into
its Training Queue as shuffled micro-batches, one per optimizer step, with backpressure (at
most ``max_in_flight`` unconsumed batches of the tenant in ``TRAIN``) and
``Nats-Msg-Id`` = (tenant, job, epoch, batch). Batch ``s`` is a pure function of the dataset,
seed and ``s``, so a restarted worker resumes from the trainer's committed progress and
re-publishes nothing twice (the trainer also skips any step it has consumed).

Every task is checked before it runs (:mod:`services.envs.limits`): its tenant and job are its
subject's (only service identities may publish on ``nexus.env.>``; the broker enforces it),
and its sizes and its dataset's are within the operator's limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial
from typing import Any

import msgspec
import numpy as np
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from bus import tracing
from bus.auth import reply_allowed
from bus.codec import DecodeError, decode, encode
from bus.datacache import DatasetCache
from bus.datasets import DatasetStoreError, resolve
from bus.durable import ConsumerSpec
from bus.errors import Interrupted, PoisonError, RetryableError
from bus.inference import InferenceError, PolicyClient
from bus.metering import BusyMeter
from bus.payloads import publish_train
from bus.publish import Outgoing, msg_id, publish, publish_all
from bus.service import Runtime, serve
from bus.usage import UsageReporter
from schemas import headers, subjects
from schemas.env import ENV_DECODER, EvalTask, RolloutTask, StreamDataset
from schemas.envctl import PREWARM_DECODER, EnvPrewarmed
from schemas.events import ErrorEvent, Metrics
from schemas.limits import InputLimits
from schemas.model import Observation
from schemas.tensor import Tensor
from schemas.train import SFTBatch
from services.envs.adapters import (
    EnvRunError,
    EnvUnavailableError,
    ProprioMismatchError,
    proprio_for_head,
)
from services.envs.config import EnvsConfig, hang_later
from services.envs.datasets import LoadedDatasets, directory_version, iter_batches
from services.envs.describe import Describer
from services.envs.flow import Flow
from services.envs.jobstate import committed_batches, iteration_done, job_ended, unconsumed
from services.envs.limits import check_dataset, check_task, prewarm_refusal
from services.envs.pool import DEFAULT_MAX_IDLE, AdapterPool, EnvMeter
from services.envs.rollouts import collect, evaluate_env
from vla.data import Dataset, DatasetError, load_dataset, read_meta

log = logging.getLogger(__name__)


DURABLE = "envs"
#: A stream that is not throttled checks whether its job ended this often.
JOB_CHECK_S = 1.0


class EnvWorker:
    """Runs env tasks: dataset streams (SFT), rollouts (RL) and evaluations."""

    def __init__(
        self,
        js: JetStreamContext,
        policies: dict[str, PolicyClient],
        stop: asyncio.Event | None = None,
        limits: InputLimits | None = None,
        dataset_cache: DatasetCache | None = None,
        max_idle_sessions: int = DEFAULT_MAX_IDLE,
    ) -> None:
        self.js = js
        #: Where tenants' pushed datasets are materialised (verified against their digests).
        self.dataset_cache = dataset_cache or DatasetCache()
        self.limits = limits or InputLimits()
        #: The service's stop event: a long stream hands its task back when it is set.
        self.stop = stop or asyncio.Event()
        #: Loaded datasets by (tenant, dataset id, path or manifest digest).
        self.datasets = LoadedDatasets()
        self.pool = AdapterPool(max_idle_sessions)
        self.policies = policies
        #: Simulator and act-request measurements (heartbeat gauges).
        self.meter = EnvMeter()
        #: Time with at least one task in hand.
        self.active = BusyMeter()
        #: SFT batches published by this worker's dataset streams.
        self.batches_streamed = 0

    async def handle(self, msg: Msg) -> None:
        try:
            task = decode(ENV_DECODER, msg.data)
        except DecodeError as exc:
            raise PoisonError(f"malformed env task: {exc}") from exc
        check_task(msg.subject, task, self.limits)
        try:
            await self.run_task(task)
        except EnvUnavailableError as exc:
            raise PoisonError(str(exc)) from exc
        except EnvRunError as exc:
            raise PoisonError(str(exc)) from exc
        except ProprioMismatchError as exc:
            raise PoisonError(str(exc)) from exc
        except DatasetError as exc:  # a frame that became unreadable after the dataset loaded
            raise PoisonError(f"dataset: {exc}") from exc
        except InferenceError as exc:
            raise (RetryableError if exc.retryable else PoisonError)(
                f"inference: {exc}", delay_s=2.0
            ) from exc

    async def run_task(self, task: StreamDataset | RolloutTask | EvalTask) -> None:
        attributes = {**tracing.job_attributes(task.tenant, task.job_id)}
        if isinstance(task, StreamDataset):
            name = "dataset stream"
        else:
            name = "env task" if isinstance(task, RolloutTask) else "env eval"
            attributes["joynexus.env"] = task.env_id or "dataset"
        with tracing.tracer().start_as_current_span(name, attributes=attributes):
            await self._run_task(task)

    async def _run_task(self, task: StreamDataset | RolloutTask | EvalTask) -> None:
        if isinstance(task, StreamDataset):
            # A stream spends its life waiting for the trainer (backpressure): work in hand
            # for the trainer, not for this worker's simulators.
            await self.stream(task)
            return
        t0 = time.perf_counter()
        with self.active.busy():
            if isinstance(task, RolloutTask):
                await self.rollout(task)
            else:
                await self.evaluate(task)
        if task.env_id:  # a dataset evaluation runs no simulator
            stats = self.meter.of(task.env_id)
            stats.tasks += 1
            stats.task_s += time.perf_counter() - t0

    def progress(self) -> int:
        """Work done besides settled tasks: a dataset stream or a rollout is one task for
        minutes, its batches and simulator steps show it moving."""
        steps = sum(s.steps + s.resets for s in self.meter.envs.values())
        return self.batches_streamed + steps

    def busy_with(self, describing: int = 0) -> str:
        """What holds the worker up without progress: building simulator sessions (and
        ``describing`` envs for the master)."""
        building = self.pool.building + describing
        return f"building {building} simulator session(s)" if building else ""

    def gauges(self) -> dict[str, float]:
        """Busy (simulating) and active (a rollout or evaluation in hand) seconds, and the
        meter's counts."""
        return {**self.meter.gauges(), **self.pool.gauges(), "active_s": self.active.busy_s}

    def client(self, backbone: str) -> PolicyClient:
        if backbone not in self.policies:
            raise RetryableError(f"no policy client for backbone {backbone!r} yet")
        return self.policies[backbone]

    async def rollout(self, task: RolloutTask) -> None:
        """Run the task's episodes; publish each as a RolloutBatch (idempotent by identity)."""
        if await job_ended(self.js, task.tenant, task.job_id) or await iteration_done(
            self.js, task
        ):
            return
        try:
            records = await collect(self.client(task.backbone), self.pool, task, self.meter)
        except InferenceError:
            # Its version pruned while it ran: another delivery's rollouts finished the
            # iteration (the trainer moves on only then), so this one has nothing to add.
            if await iteration_done(self.js, task):
                return
            raise
        subject = subjects.train(task.backbone, task.tenant)
        # An episode over the server's max_payload goes by reference (bus.payloads).
        await publish_all(
            self.js,
            [
                Outgoing(
                    subject,
                    r,
                    msg_id("rollout", r.tenant, r.job_id, r.iteration, r.episode),
                    headers={headers.JOB_ID: r.job_id},
                )
                for r in records
            ],
            send=partial(publish_train, max_bytes=self.limits.max_message_bytes),
        )

    async def evaluate(self, task: EvalTask) -> None:
        """Read-only: run the pinned policy and report metrics; nothing reaches TRAIN."""
        client = self.client(task.backbone)
        if task.env_id:
            metrics = await evaluate_env(client, self.pool, task, self.meter)
        else:
            metrics = await self.evaluate_dataset(client, task)
        await publish(
            self.js,
            subjects.event(task.tenant, task.job_id, "metrics"),
            Metrics(task.tenant, task.job_id, -1, metrics, time.time()),
            message_id=msg_id("ev", task.tenant, task.job_id, "metrics", "eval"),
        )

    async def evaluate_dataset(self, client: PolicyClient, task: EvalTask) -> dict[str, float]:
        """Action error of the policy's deterministic actions on held-out episodes."""
        ds = await self.dataset(task.tenant, task.dataset)
        _, held_out = ds.split(task.val_fraction, task.seed)
        if not held_out:
            raise PoisonError(f"val_fraction {task.val_fraction} holds out no episode")
        sq_err, abs_err, count = 0.0, 0.0, 0
        for batch in iter_batches(ds, 16, task.chunk_len, seed=task.seed, episodes=held_out):
            observations = [
                Observation(
                    [
                        Tensor.from_numpy(np.ascontiguousarray(v))
                        for v in batch.images_B_V_H_W_3[b, : task.num_views]
                    ],
                    batch.instructions[b],
                    Tensor.from_numpy(
                        np.ascontiguousarray(proprio_for_head(batch.state_B_S[b], task.proprio_dim))
                    ),
                )
                for b in range(len(batch.instructions))
            ]
            reply = await client.act(
                task.tenant,
                task.policy_job,
                observations,
                policy_version=task.policy_version,
                deterministic=True,
                num_views=task.num_views,
                token_budget=task.token_budget,
                timeout=60.0,
            )
            assert reply.actions is not None
            predicted = reply.actions.to_numpy()
            label = f"policy {task.policy_job} v{reply.policy_version}"
            if predicted.shape != batch.actions_B_C_A.shape:
                raise EnvRunError(
                    f"{label} answered actions of shape {predicted.shape} for the dataset's "
                    f"{batch.actions_B_C_A.shape}"
                )
            if not np.isfinite(predicted).all():
                raise EnvRunError(f"{label} answered non-finite actions")
            valid = ~batch.action_pad_B_C[..., None]
            error = (predicted - batch.actions_B_C_A) * valid
            sq_err += float((error**2).sum())
            abs_err += float(np.abs(error).sum())
            count += int(valid.sum()) * predicted.shape[-1]
        return {
            "action_mse": sq_err / max(1, count),
            "action_l1": abs_err / max(1, count),
            "held_out_episodes": float(len(held_out)),
            "policy_version": float(task.policy_version),
        }

    async def dataset(self, tenant: str, dataset_id: str) -> Dataset:
        """Dataset ``dataset_id`` of ``tenant``'s namespace (the ``datasets`` KV: a registered
        directory, or a pushed dataset materialised into the cache, every file verified
        against its digest), fully validated: the master checked only its metadata and a
        sample, so a bad frame anywhere is found here and fails the job, naming the frame."""
        try:
            path, record = await resolve(self.js, tenant, dataset_id, self.dataset_cache)
        except DatasetStoreError as exc:
            raise (RetryableError if exc.retryable else PoisonError)(f"dataset: {exc}") from exc
        version = record.digest or directory_version(path, record.created_at)
        loaded = self.datasets.get(tenant, dataset_id, version)
        if loaded is None:
            try:
                # Within the operator's limits before any frame is read.
                meta = await asyncio.to_thread(read_meta, path)
                await asyncio.to_thread(check_dataset, dataset_id, meta, self.limits)
                loaded = await asyncio.to_thread(load_dataset, path)
            except DatasetError as exc:
                raise PoisonError(f"dataset {dataset_id!r}: {exc}") from exc
            self.datasets.put(tenant, dataset_id, version, loaded)
        return loaded

    async def stream(self, task: StreamDataset) -> None:
        ds = await self.dataset(task.tenant, task.dataset)
        train_episodes, _ = ds.split(task.val_fraction, task.seed)
        per_epoch = ds.num_batches(task.batch_size, train_episodes, drop_last=True)
        if per_epoch == 0:
            raise PoisonError(
                f"dataset {task.dataset}: fewer training frames than batch_size {task.batch_size}"
            )
        subject = subjects.train(task.backbone, task.tenant)
        step = await committed_batches(self.js, task)
        log.info(
            "streaming %s/%s from step %d of %d", task.tenant, task.job_id, step, task.total_steps
        )
        # Backpressure follows the trainer's commits (services.envs.flow): no request per
        # batch, and a throttled stream wakes when a commit lands instead of polling.
        flow = Flow(
            await self.js.key_value(subjects.KV_POLICIES),
            task.tenant,
            task.job_id,
            lambda: unconsumed(self.js, task.backbone, task.tenant),
        )
        await flow.start(committed=step)
        try:
            await self._stream_batches(task, subject, step, per_epoch, train_episodes, ds, flow)
        finally:
            await flow.close()

    async def _stream_batches(
        self,
        task: StreamDataset,
        subject: str,
        step: int,
        per_epoch: int,
        train_episodes: Any,
        ds: Dataset,
        flow: Flow,
    ) -> None:
        batches: Any = None
        epoch = -1
        checked_at = -1e9
        while step < task.total_steps:
            if self.stop.is_set():
                raise Interrupted(f"stopping at step {step} of {task.tenant}/{task.job_id}")
            throttled = flow.in_flight >= task.max_in_flight
            # A cancelled job stops its stream: checked when throttled and once a second,
            # not per batch (at most max_in_flight batches go out for an ended job).
            if throttled or time.monotonic() - checked_at >= JOB_CHECK_S:
                checked_at = time.monotonic()
                if await job_ended(self.js, task.tenant, task.job_id):
                    log.info(
                        "job %s/%s ended; stream stops at step %d", task.tenant, task.job_id, step
                    )
                    return
            if throttled:
                await flow.wait_below(task.max_in_flight, self.stop)
                continue
            want_epoch, index = divmod(step, per_epoch)
            if want_epoch != epoch:
                epoch = want_epoch
                batches = iter_batches(
                    ds,
                    task.batch_size,
                    task.chunk_len,
                    seed=task.seed,
                    epoch=epoch,
                    episodes=train_episodes,
                    drop_last=True,
                    start_batch=index,
                )
            batch = await asyncio.to_thread(next, batches)
            message = SFTBatch(
                tenant=task.tenant,
                job_id=task.job_id,
                step=step,
                epoch=epoch,
                batch_index=batch.batch_index,
                images=Tensor.from_numpy(batch.images_B_V_H_W_3[:, : task.num_views]),
                instructions=list(batch.instructions),
                proprio=Tensor.from_numpy(
                    np.ascontiguousarray(proprio_for_head(batch.state_B_S, task.proprio_dim))
                ),
                actions=Tensor.from_numpy(batch.actions_B_C_A.astype(np.float32)),
                action_pad=Tensor.from_numpy(batch.action_pad_B_C),
            )
            await publish_train(
                self.js,
                subject,
                message,
                message_id=msg_id("sft", task.tenant, task.job_id, epoch, batch.batch_index),
                headers={headers.JOB_ID: task.job_id},
                max_bytes=self.limits.max_message_bytes,
            )
            flow.published()
            self.batches_streamed += 1
            step += 1

    async def prewarm(self, msg: Msg, instance: str) -> None:
        """An operator's (or the demo's) :class:`~schemas.envctl.PrewarmEnv`: build the
        sessions, answer how many are idle. Answered only on an inbox; a request past the
        limits or for an env that cannot be built gets its reason."""
        if not msg.reply or not reply_allowed(msg.reply):
            return
        try:
            request = decode(PREWARM_DECODER, msg.data)
        except DecodeError as exc:
            await self._respond(msg, EnvPrewarmed(instance, "", error=f"malformed: {exc}"))
            return
        answer = EnvPrewarmed(instance, request.env_id[:200])
        refusal = prewarm_refusal(request, self.limits)
        if refusal:
            answer = msgspec.structs.replace(answer, error=refusal)
        else:
            try:
                idle, built = await self.pool.prewarm(
                    request.env_id,
                    request.image_size,
                    request.max_episode_steps,
                    request.sessions,
                    dict(request.env_kwargs),
                )
                answer = msgspec.structs.replace(answer, idle=idle, built=built)
            except Exception as exc:  # noqa: BLE001 - any env's constructor may raise anything
                answer = msgspec.structs.replace(answer, error=f"{type(exc).__name__}: {exc}")
        await self._respond(msg, answer)

    @staticmethod
    async def _respond(msg: Msg, answer: EnvPrewarmed) -> None:
        try:
            await msg.respond(encode(answer))
        except NatsError as exc:  # the requester is gone: nothing to tell
            log.info("prewarm answer not sent: %s", exc)

    async def on_dead(self, msg: Msg, reason: str, error: BaseException) -> None:
        """The job of the task's subject (never the one its payload claims) fails, with the
        reason. Only for a payload that is an env task at all: anything else on ENV is not
        the subject's tenant's doing (tenants cannot publish there, but the server writes a
        JetStream publish acknowledgement to whatever reply subject a publisher names, e.g.
        ``nexus.env.<victim>.<job>``), so its dead letter is its only record."""
        try:
            decode(ENV_DECODER, msg.data)
            tenant, job_id = subjects.parse_env(msg.subject)
        except (DecodeError, subjects.SubjectError):
            return  # the dead letter is the record
        await publish(
            self.js,
            subjects.event(tenant, job_id, "error"),
            ErrorEvent(tenant, job_id, reason, False, True, time.time()),
            message_id=msg_id("ev", tenant, job_id, "error", "env"),
        )


async def run(config: EnvsConfig) -> None:
    """Entry point: serve an env worker until SIGTERM/SIGINT."""

    async def body(rt: Runtime) -> None:
        # Answering describe requests first: the master's submits wait on them.
        describer = Describer(config.limit)
        await describer.subscribe(rt.nc)
        policies: dict[str, PolicyClient] = {}
        worker = EnvWorker(
            rt.js,
            policies,
            rt.stop,
            config.limit,
            config.dataset_cache_settings(),
            config.max_idle_sessions,
        )
        rt.gauges = worker.gauges
        usage = UsageReporter(
            rt.js,
            "envs",
            rt.instance,
            worker.meter.usage,
            lambda: worker.meter.call_s,
            config.usage_report_s,
        )
        rt.spawn(usage.loop(rt.stop), "usage report")
        rt.busy_with = lambda: worker.busy_with(describer.building)
        worker.pool.on_build = describer.on_build = rt.beat_now
        rt.progress = worker.progress
        if config.hang_after_s > 0 and config.hang_marker:
            rt.spawn(hang_later(config, rt.stop), "fault injection")
        prewarms = await rt.nc.subscribe(
            subjects.ENVS_PREWARM, cb=partial(worker.prewarm, instance=rt.instance)
        )
        for backbone in config.backbones.split(","):
            policies[backbone] = await PolicyClient.create(rt.nc, backbone, rt.js)
        tasks = await rt.consumer.bind(
            ConsumerSpec(
                subjects.STREAM_ENV,
                DURABLE,
                f"{subjects.PREFIX}.env.>",
                ack_wait_s=config.ack_wait_s,
                max_deliver=config.max_deliver,
            ),
            on_dead=worker.on_dead,
        )
        try:
            await rt.consumer.run(tasks, worker.handle, concurrency=config.concurrency)
            await usage.report(timeout=1.0)  # what the last tasks charged
        finally:
            with contextlib.suppress(NatsError):
                await prewarms.unsubscribe()
            await describer.close()
            for client in policies.values():
                await client.close()
            worker.pool.close()

    await serve("envs", config, body)
