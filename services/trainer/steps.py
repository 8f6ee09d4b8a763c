"""Applying training work to slots: one grouped SFT step over the round's chosen batches, and
one RL update per complete iteration. Each outcome is recorded on its job — applied, dropped
(non-finite: the step still counts as consumed, durably from the next commit on) or failed
(the job fails; the trainer serves everyone else)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from bus.errors import PoisonError, RetryableError
from bus.metering import LinearFit
from schemas.events import Progress
from schemas.train import ForwardBackward, RolloutBatch, SFTBatch
from services.trainer import rl, session
from services.trainer.checks import check_rollout_fits, sft_non_finite
from services.trainer.jobs import JobSlot
from services.trainer.ledger import Verdict, episode_verdict
from services.trainer.sft import build_request
from services.trainer.spans import trace_round, trace_update
from services.trainer.triage import settle_consumed
from vla.backbone import Backbone
from vla.featurecache import FeatureCache
from vla.grouping import FeatureEncoder, Phase, TrainRequest, group_train_step
from vla.slot import NonFiniteLossError, StepResult

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from services.trainer.service import Trainer


def backing_off(error: RetryableError, msg: Msg) -> RetryableError:
    """``error`` with a nak delay doubling per delivery (2 s, 4 s, ... 30 s): ten deliveries
    then span about three minutes, the time a backbone role has to come back before the
    message is dead-lettered."""
    delay = min(30.0, 2.0**msg.metadata.num_delivered)
    return RetryableError(str(error), delay_s=delay)


class Stepper:
    """Runs the trainer's compute (in a worker thread) and books its results."""

    def __init__(self, trainer: Trainer, backbone: Backbone) -> None:
        self.trainer = trainer
        self.backbone = backbone
        #: What the grouped step encodes with: the backbone, or a vla.costmodel.SplitEncoder
        #: over it where a cost table says smaller forwards are faster (set by the service).
        self.encoder: FeatureEncoder = backbone
        #: The last round's progress events, still being published.
        self._announcing: asyncio.Future[None] | None = None
        #: What RL updates encode with (no cache: every observation is new): the backbone, or
        #: the backbone role's encoder (set by the service).
        self.rl_encoder: FeatureEncoder = backbone
        #: The feature cache in front of the encoder (None: off; set by the service).
        self.cache: FeatureCache | None = None
        self.compute_s = 0.0
        self.round_s = 0.0
        self.samples = 0
        #: Compute seconds of a grouped SFT step against its samples, and of an RL update
        #: against its episodes' steps (the simulator's training costs).
        self.sft_fit = LinearFit()
        self.rl_fit = LinearFit()
        #: Seconds the round's batches waited since they were published (queueing in TRAIN
        #: and in the trainer's buffers), summed, and how many.
        self.queue_wait_s = 0.0
        self.queued = 0

    # -- SFT ---------------------------------------------------------------------------------
    async def step(
        self,
        chosen: list[tuple[Msg, SFTBatch | ForwardBackward, JobSlot]],
        during: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """One grouped step over ``chosen`` (their slots fit the budget together).
        ``during``: what the event loop does while the step computes in its thread (the
        trainer fetches the next round's batches)."""
        consumer = self.trainer.consumer
        t0 = time.perf_counter()
        slots = self.trainer.slots.acquire([job.key for _, _, job in chosen])
        requests: list[TrainRequest] = []
        accepted: list[tuple[Msg, SFTBatch | ForwardBackward, JobSlot]] = []
        calls: list[tuple[Msg, ForwardBackward, JobSlot]] = []
        for (msg, batch, job), slot in zip(chosen, slots, strict=True):
            job.slot = slot
            if isinstance(batch, ForwardBackward):
                try:
                    requests.append(session.build_call_request(job, batch))
                    accepted.append((msg, batch, job))
                except ValueError as exc:
                    self.book_call(msg, batch, job, exc)
                    calls.append((msg, batch, job))  # answered with the round's, not later
                continue
            non_finite = sft_non_finite(batch)
            if non_finite is not None:
                # Dropped, and consumed, like a non-finite loss below: the job goes on.
                job.batches_done = batch.step + 1
                job.held.append(
                    (msg, job.error(f"step {batch.step} dropped: {non_finite}", fatal=False))
                )
                continue
            try:
                requests.append(build_request(job, batch))
                accepted.append((msg, batch, job))
            except ValueError as exc:
                job.closed = True
                await consumer.settle(msg, job.error(f"bad batch at step {batch.step}: {exc}"))
        if not requests:
            for _, _, job in chosen:
                await self.trainer.committer.publish_results(job)
            return
        started = time.time()
        for msg, _, _ in accepted:
            self.queue_wait_s += max(0.0, started - msg.metadata.timestamp.timestamp())
        self.queued += len(accepted)
        compute_t0 = time.perf_counter()
        timeline: list[Phase] = []
        compute_start_ns = time.time_ns()
        compute = asyncio.ensure_future(
            asyncio.to_thread(group_train_step, self.encoder, requests, timeline=timeline)
        )
        if during is not None:
            # The compute's own outcome is awaited below; a failure of ``during`` (a fetch
            # the broker refused) must not lose it.
            _, fetched = await asyncio.gather(compute, during(), return_exceptions=True)
            if isinstance(fetched, BaseException):
                log.warning("fetch during the step failed: %s", fetched)
        try:
            results = await compute
        except Exception:
            self.trainer.guard.raised(msg for msg, _, _ in accepted)  # a bug: counted
            raise
        compute_s = time.perf_counter() - compute_t0
        compute_end_ns = compute_start_ns + int(compute_s * 1e9)
        self.compute_s += compute_s
        self.sft_fit.add(sum(r.actions_B_C_A.shape[0] for r in requests), compute_s)
        usage = self.trainer.usage
        shares: Counter[tuple[str, str]] = Counter()
        for (_, _, job), request in zip(accepted, requests, strict=True):
            shares[(job.spec.tenant, job.spec.job_id)] += request.actions_B_C_A.shape[0]
        usage.split(compute_s, shares)
        # How many of the round's batches each backbone forward took (one per group key).
        sharing = Counter(r.inputs.key for r in requests)
        trace_round(
            [(job.key, msg, getattr(batch, "step", 0)) for msg, batch, job in accepted],
            results,
            timeline,
            compute_start_ns,
            compute_end_ns,
        )
        now = time.time()
        events: list[Progress] = []
        for (msg, batch, job), request in zip(accepted, requests, strict=True):
            result = results[job.key]
            if isinstance(result, RetryableError):
                # The features did not come (the backbone role is away or stopping): nothing
                # was applied, and the batch goes back to be retried; the job goes on.
                log.warning("step of %s handed back: %s", job.key, result)
                await consumer.settle(msg, backing_off(result, msg))
                continue
            if isinstance(batch, ForwardBackward):
                if not isinstance(result, Exception):
                    samples = request.actions_B_C_A.shape[0]
                    usage.charge(job.spec.tenant, job.spec.job_id, samples=samples)
                self.book_call(msg, batch, job, result, sharing[request.inputs.key])
                calls.append((msg, batch, job))
                continue
            if isinstance(result, NonFiniteLossError):
                # Dropped, and consumed: the next commit records that, then dead-letters it.
                job.batches_done = batch.step + 1
                dropped = job.error(f"step {batch.step} dropped: {result}", fatal=False)
                job.held.append((msg, dropped))
                continue
            if isinstance(result, Exception):
                job.closed = True
                await consumer.settle(msg, job.error(f"step {batch.step} failed: {result}"))
                continue
            job.applied_seq = max(job.applied_seq, msg.metadata.sequence.stream)
            job.batches_done = batch.step + 1
            job.held.append((msg, None))
            samples = request.actions_B_C_A.shape[0]
            self.samples += samples
            usage.charge(job.spec.tenant, job.spec.job_id, samples=samples)
            job.metrics = {
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "lr": result.lr,
                "samples_per_s": samples / max(1e-9, time.perf_counter() - t0),
            }
            events.append(self.progress(job, result.step, now))
        await self.announce(events)
        committer = self.trainer.committer
        answering = {job.key: job for _, _, job in calls}.values()
        await asyncio.gather(*(committer.publish_results(job) for job in answering))
        self.round_s += time.perf_counter() - t0

    def book_call(
        self,
        msg: Msg,
        call: ForwardBackward,
        job: JobSlot,
        outcome: StepResult | Exception,
        group_size: int = 1,
    ) -> None:
        """A session's forward(-backward) is done (applied, or refused with its error: the
        session goes on, the message is dead-lettered at the next commit). ``group_size``:
        the batches of the round that shared its backbone forward."""
        job.batches_done = call.call + 1
        answer = session.forward_result(job, call, outcome, group_size)
        job.results.append(answer)
        if answer.error:
            job.held.append((msg, job.error(answer.error, fatal=False)))
            return
        job.applied_seq = max(job.applied_seq, msg.metadata.sequence.stream)
        job.held.append((msg, None))
        self.samples += call.actions.shape[0]

    def progress(self, job: JobSlot, step: int, now: float) -> Progress:
        spec = job.spec
        return Progress(spec.tenant, spec.job_id, step, spec.total_steps, dict(job.metrics), now)

    # -- RL ----------------------------------------------------------------------------------
    async def collect(self, msg: Msg, body: RolloutBatch, job: JobSlot) -> Verdict:
        """Hold an episode of the job's current iteration; later iterations wait; earlier or
        duplicate episodes are consumed. Raises the job's error for a stale rollout."""
        rl_config = job.spec.rl
        if rl_config is None:
            raise job.error(f"rollout records sent to supervised job {body.job_id!r}")
        try:
            check_rollout_fits(body, job.spec)
        except PoisonError as exc:
            raise job.error(f"rollout of episode {body.episode}: {exc}") from exc
        verdict = episode_verdict(
            job.batches_done, job.rollouts, body.iteration, body.episode, job.committed_batches
        )
        if verdict is Verdict.CONSUMED:
            await settle_consumed(self.trainer.consumer, msg, job)
        if verdict is not Verdict.COLLECT:
            return verdict
        lag = job.slot.version - body.policy_version
        if lag > rl_config.max_policy_lag or lag < 0:
            raise job.error(
                f"stale rollout: episode {body.episode} of iteration {body.iteration} was "
                f"collected with policy v{body.policy_version}, the job is at "
                f"v{job.slot.version} and accepts a lag of {rl_config.max_policy_lag}"
            )
        job.rollouts[body.episode] = (msg, body)
        return verdict

    async def rl_updates(self) -> None:
        """One PPO/GRPO update for every job whose iteration is complete (as many as fit the
        slot budget at once; the rest go next round)."""
        trainer = self.trainer
        complete = {j.key: j for j in trainer.registry.jobs.values() if j.iteration_complete}
        keys = trainer.slots.fits([k for k, j in complete.items() if not j.closed])
        if not keys:
            return
        episodes = {k: [m for m, _ in complete[k].rollouts.values()] for k in keys}
        # An update that was running when the process died before runs alone (crashguard.py).
        alone = await trainer.guard.suspect(episodes)
        if alone is not None:
            keys = [alone]
            await trainer.committer.drain()  # alone: no other job's commit in flight either
        dead = await trainer.guard.begin(m for k in keys for m in episodes[k])
        for key in keys:
            if any(m is d for m in episodes[key] for d in dead):
                # Dead-lettered (its update killed the process): the job fails, and the rest
                # of its iteration is consumed unapplied.
                complete[key].closed = True
                complete[key].rollouts.clear()
                alive = [m for m in episodes[key] if not any(m is d for d in dead)]
                await trainer.consumer.release(alive)
        keys = [k for k in keys if not complete[k].closed]
        if not keys:
            return
        ready = [complete[k] for k in keys]
        slots = trainer.slots.acquire(keys)
        iterations = []
        for job, slot in zip(ready, slots, strict=True):
            job.slot = slot
            assert job.spec.rl is not None
            bodies = [job.rollouts[e][1] for e in sorted(job.rollouts)]
            iterations.append(
                rl.Iteration(
                    job.key,
                    slot,
                    job.normaliser,
                    job.spec.rl,
                    bodies,
                    slot.version,
                    iteration=job.batches_done,
                )
            )
        t0 = time.perf_counter()
        start_ns = time.time_ns()
        try:
            results = await asyncio.to_thread(rl.update_iterations, self.rl_encoder, iterations)
        except Exception:
            trainer.guard.raised(m for k in keys for m in episodes[k])  # a bug: counted
            raise
        finally:
            await trainer.guard.returned(m for k in keys for m in episodes[k])
        end_ns = time.time_ns()
        compute_s = time.perf_counter() - t0
        self.compute_s += compute_s
        steps = sum(b.rewards.shape[0] for it in iterations for b in it.episodes)
        self.rl_fit.add(steps, compute_s)
        shares: Counter[tuple[str, str]] = Counter()
        for job, it in zip(ready, iterations, strict=True):
            shares[(job.spec.tenant, job.spec.job_id)] += sum(
                b.rewards.shape[0] for b in it.episodes
            )
        trainer.usage.split(compute_s, shares)
        events = []
        for job in ready:
            result = results[job.key]
            iteration = job.batches_done
            msgs = [m for m, _ in job.rollouts.values()]
            job.rollouts.clear()
            error = str(result) if isinstance(result, Exception) else None
            trace_update(job.key, msgs, iteration, start_ns, end_ns, error)
            if isinstance(result, RetryableError):
                # The features did not come: nothing was applied; the episodes go back and are
                # collected again when redelivered.
                log.warning("RL update of %s handed back: %s", job.key, result)
                for m in msgs:
                    await trainer.consumer.settle(m, backing_off(result, m))
                continue
            if isinstance(result, NonFiniteLossError):
                # Skipped with the slot untouched: the iteration still counts, so the job
                # gets a new version and its next rollouts.
                job.batches_done += 1
                skipped = job.error(f"iteration {iteration} skipped: {result}", fatal=False)
                job.held.extend((m, skipped) for m in msgs)
                continue
            if isinstance(result, Exception):
                job.closed = True
                failed = job.error(f"RL update of iteration {iteration} failed: {result}")
                await trainer.consumer.release(msgs, failed)
                continue
            job.applied_seq = max(job.applied_seq, *(m.metadata.sequence.stream for m in msgs))
            job.batches_done += 1
            job.held.extend((m, None) for m in msgs)
            job.metrics = result
            learned = int(result.get("episode_length", 0) * result.get("episodes", 0))
            self.samples += learned
            trainer.usage.charge(job.spec.tenant, job.spec.job_id, samples=learned)
            events.append(self.progress(job, job.batches_done, time.time()))
        await self.announce(events)

    async def announce(self, events: list[Progress]) -> None:
        """Progress events, published while the next round computes: a round does not wait
        for their acks. One round's events at most are in flight, so a job's progress stays
        in order. One the broker cannot take now is skipped (the next step's, and the
        commit's policy event, carry the job on)."""
        await self.announced()
        self._announcing = asyncio.ensure_future(self._publish_progress(events))

    async def announced(self) -> None:
        """Wait until the progress events in flight are published (or skipped)."""
        if self._announcing is not None:
            await self._announcing
            self._announcing = None

    async def _publish_progress(self, events: list[Progress]) -> None:
        results = await asyncio.gather(
            *(self.trainer.emit(ev, step_id=ev.step) for ev in events), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                log.warning("progress event not published: %s", result)

    def gauges(self) -> dict[str, float]:
        return {
            "samples": float(self.samples),
            "compute_s": self.compute_s,
            "busy_s": self.compute_s,
            "round_s": self.round_s,
            "queue_wait_s": self.queue_wait_s,
            "queued": float(self.queued),
            **self.sft_fit.gauges("sft_step"),
            **self.rl_fit.gauges("rl_update"),
            **(self.cache.stats() if self.cache is not None else {}),
        }
