"""Master service: ``nexus.job.<tenant>.<verb>`` → validated, recorded, announced.

A submit is validated against :mod:`schemas.specs`; an accepted job is written to the
``jobs`` KV (status ``accepted``) and an ``accepted`` event is published; a bad one is
dead-lettered and the tenant gets a ``rejected`` event naming the bad field. A malformed
message never stops the master: its fate is decided by :meth:`bus.consume.Consumer.settle`.
"""

from __future__ import annotations

import logging
import time

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from bus import tracing
from bus.codec import DecodeError, decode, encode
from bus.durable import ConsumerSpec
from bus.errors import PoisonError, RetryableError
from bus.publish import msg_id, publish, publish_event
from bus.queues import publish_queues
from bus.records import RevisionConflict, get_job, job_removed, list_jobs, put_job
from bus.service import Runtime, serve
from bus.sweep import sweep_every
from schemas import headers, subjects
from schemas.events import (
    EVENT_DECODER,
    Accepted,
    ErrorEvent,
    Metrics,
    PolicyPublished,
    StateChanged,
)
from schemas.jobs import (
    TERMINAL_STATUSES,
    JobCancel,
    JobCommand,
    JobRecord,
    JobStatus,
    JobSubmit,
)
from schemas.limits import InputLimits
from schemas.masterstate import MASTER_STATE_SUBJECT, LeasedSession, MasterState, QueuedJob
from schemas.specs import (
    JobSpec,
    JobSpecError,
    PipelineSpec,
    RLJobSpec,
    SessionSpec,
    SFTJobSpec,
    parse_job_spec,
)
from schemas.subjects import EventKind
from schemas.tenants import TenantLimits
from schemas.train import CloseSlot, PolicyRecord
from services.master.admission import Admissions
from services.master.backbones import BackboneWatch
from services.master.commands import answer_refused, parse_command
from services.master.compiler import Compiler
from services.master.config import MasterConfig
from services.master.envfit import EnvDescriptions
from services.master.limits import (
    TenantGate,
    check_fits,
    check_size,
    check_spec_bounds,
)
from services.master.pacing import Pacer
from services.master.pipelines import advance_pipeline, check_stage_ids, end_stages, start_stage
from services.master.plans import (
    Datasets,
    Plan,
    rollout_tasks,
)
from services.master.queries import Queries

log = logging.getLogger(__name__)

#: The event kinds :meth:`Master.handle_event` acts on, the only ones its durable fetches.
MASTER_EVENT_KINDS: tuple[EventKind, ...] = ("policy", "error", "metrics")


class Master:
    """Handlers of the master; state lives in the bus (KV), not in this object."""

    def __init__(
        self,
        js: JetStreamContext,
        jobs: KeyValue,
        policies: KeyValue,
        backbones: BackboneWatch | None = None,
        envs: EnvDescriptions | None = None,
        limits: InputLimits | None = None,
        datasets: Datasets | None = None,
    ) -> None:
        self.js = js
        #: Operator bounds on commands and specs; registered tenants and their job limits.
        self.limits = limits or InputLimits()
        self.gate = TenantGate(js)
        self.jobs = jobs
        self.policies = policies
        self.compiler = Compiler(
            policies,
            self.limits,
            backbones,
            envs if envs is not None else EnvDescriptions(js._nc),
            datasets if datasets is not None else Datasets(js),
            jobs,
        )
        #: Queued jobs and the loop that starts them (its lock orders admissions).
        self.admissions = Admissions(self)

    async def handle(self, msg: Msg) -> None:
        await self.apply(parse_command(msg, self.limits))

    async def state(self, leases: dict[tuple[str, str], tuple[float, float]]) -> MasterState:
        """What this master decides from: the job table and what it holds in memory from it
        (queued jobs, sessions' leases; see :mod:`schemas.masterstate`)."""
        jobs = sorted(await list_jobs(self.js), key=lambda r: (r.tenant, r.job_id))
        queued = [QueuedJob(t, j, at) for (t, j), at in sorted(self.admissions.jobs.items())]
        sessions = [LeasedSession(t, j, lease) for (t, j), (_, lease) in sorted(leases.items())]
        return MasterState(jobs, queued, sessions)

    async def apply(self, command: JobCommand) -> None:
        match command:
            case JobSubmit():
                await self.submit(command)
            case JobCancel():
                await self.cancel(command)
            case _:
                raise PoisonError(f"{type(command).__name__} is not supported yet")

    async def record(self, tenant: str, job_id: str) -> tuple[JobRecord, int] | None:
        record, revision = await get_job(self.jobs, tenant, job_id)
        return None if record is None else (record, revision)

    async def submit(self, command: JobSubmit) -> None:
        tracing.tag_job(command.tenant, command.job_id)
        existing = await self.record(command.tenant, command.job_id)
        if existing is not None:
            if existing[0].spec_json != command.spec_json:
                raise PoisonError(f"job id {command.job_id!r} is already used by another job")
            if existing[0].status != "accepted":
                return  # a replayed submit of a started job: nothing to do
            # Accepted but maybe not started (crash in between): starting is idempotent.
        check_size("spec", len(command.spec_json), "max_spec_bytes", self.limits.max_spec_bytes)
        try:
            spec = parse_job_spec(command.spec_json)
        except JobSpecError as exc:
            raise PoisonError(f"invalid job spec: {exc}") from exc
        if spec.tenant != command.tenant:
            raise PoisonError(
                f"tenant: spec says {spec.tenant!r} but it was submitted as {command.tenant!r}"
            )
        check_spec_bounds(spec, self.limits)
        if isinstance(spec, PipelineSpec):
            check_stage_ids(command.job_id, spec)
        async with self.admissions.lock:
            tenant = await self.gate.record(spec.tenant)
            limits = tenant.limits if tenant is not None else None
            wait = ""
            if limits is not None:
                check_fits(spec, limits)
                wait = await self.gate.wait_reason(
                    spec.tenant, command.job_id, spec, limits, new=True
                )
            await self.accept(
                command.job_id, spec, command.spec_json, parent="", limits=limits, wait=wait
            )

    async def accept(
        self,
        job_id: str,
        spec: JobSpec,
        spec_json: bytes,
        parent: str,
        limits: TenantLimits | None = None,
        wait: str = "",
    ) -> None:
        """Compile (validating what the spec points at), record, announce and start a job;
        or, with ``wait`` (why it must wait for its tenant's running jobs), record it
        ``queued`` with that reason, to be started by :meth:`admit_queued`."""
        plan = await self.compile(job_id, spec, limits)
        now = time.time()
        record = JobRecord(
            tenant=spec.tenant,
            job_id=job_id,
            kind=spec.kind,
            status="accepted",
            spec_json=spec_json,
            created_at=now,
            updated_at=now,
            parent=parent,
        )
        found = await self.record(spec.tenant, job_id)
        if found is None and await job_removed(self.jobs, spec.tenant, job_id):
            # A submit replayed from JOBS, or a pipeline's stage, under a removed job's id.
            raise PoisonError(
                f"job id {job_id!r} was a job of tenant {spec.tenant} that was removed: "
                "submit under a new id"
            )
        if found is None:
            await put_job(self.jobs, record, last=0)
            log.info("accepted %s job %s/%s", spec.kind, spec.tenant, job_id)
        elif found[0].parent != parent or found[0].spec_json != spec_json:
            # Not this submit replayed: a pipeline's stage id the tenant used for a job of
            # its own, or the other way round. Taken over, it would be run twice over.
            other = found[0]
            raise PoisonError(
                f"job id {job_id!r} is already used by another job of tenant {spec.tenant} "
                f"({other.kind}, {other.status}"
                + (f", a stage of pipeline {other.parent!r}" if other.parent else "")
                + ")"
            )
        else:
            record = found[0]  # a replayed submit (the job is recorded, not started yet)
        # Announced on every pass, not only the one that recorded the job: a failure between
        # the two must not lose the event, and its msg id makes a repeat a no-op.
        await publish_event(self.js, Accepted(spec.tenant, job_id, spec.kind, record.created_at))
        if wait:
            await self.transition(spec.tenant, job_id, "queued", reason=wait)
            log.info("queued %s/%s: %s", spec.tenant, job_id, wait)
            return
        await self.begin(job_id, spec, plan)

    async def begin(self, job_id: str, spec: JobSpec, plan: Plan | None) -> None:
        """Start an accepted (or admitted) job: its plan, or a pipeline's first stage."""
        if plan is None:  # a pipeline: its first stage is the plan
            assert isinstance(spec, PipelineSpec)
            await self.transition(spec.tenant, job_id, "running")
            await start_stage(self, job_id, spec, 0, previous=None)
            return
        await self.start(plan, job_id)

    async def compile(
        self, job_id: str, spec: JobSpec, limits: TenantLimits | None = None
    ) -> Plan | None:
        """The job's plan (None for a pipeline), served as its tenant's ``limits`` say."""
        return await self.compiler.compile(job_id, spec, limits)

    async def start(self, plan: Plan, job_id: str) -> None:
        """Open the slot, hand out the env tasks, mark the job running. Every publish has a
        content-derived msg id, so a replayed submit repeats nothing."""
        tenant = plan.open_slot.tenant if plan.open_slot else plan.env_tasks[0].tenant
        if plan.open_slot is not None:
            await publish(
                self.js,
                subjects.train(plan.backbone, tenant),
                plan.open_slot,
                message_id=msg_id("open", tenant, job_id),
                headers={headers.JOB_ID: job_id},
            )
        for i, task in enumerate(plan.env_tasks):
            await publish(
                self.js,
                subjects.env(tenant, job_id),
                task,
                message_id=msg_id("env", tenant, job_id, i),
            )
        try:
            started = await self.transition(tenant, job_id, "running")
        except RevisionConflict:
            # Its record changed meanwhile (a cancel, a pipeline's end): decide on it anew.
            started = await self.transition(tenant, job_id, "running")
        if started is None and plan.open_slot is not None:
            # It ended while it was being started: the CloseSlot its end published may have
            # gone before this OpenSlot, and the trainer would hold the slot for good.
            await publish(
                self.js,
                subjects.train(plan.backbone, tenant),
                CloseSlot(tenant, job_id, "ended while it was being started"),
                message_id=msg_id("close-after-start", tenant, job_id),
                headers={headers.JOB_ID: job_id},
            )

    async def transition(
        self,
        tenant: str,
        job_id: str,
        status: JobStatus,
        reason: str = "",
        metrics: dict[str, float] | None = None,
        policy_version: int | None = None,
    ) -> JobRecord | None:
        """Move a job's state (compare-and-set on its KV revision); terminal states stick.

        Returns the record, or None where the job had ended otherwise. Entering the terminal
        state it is in already is its handler run again after a failure past the record's
        write (its event redelivered): what follows the write is done again (each step is
        idempotent), so a lost ``StateChanged`` or a pipeline's next stage is not lost."""
        found = await self.record(tenant, job_id)
        if found is None:
            raise PoisonError(f"unknown job {tenant}/{job_id}")
        record, revision = found
        if record.status in TERMINAL_STATUSES:
            if record.status != status:
                return None
            if not await self._state_event_stored(record):
                await self._entered(record, record.reason)
            elif record.parent:
                await advance_pipeline(self, record)  # (guarded: a stage starts once)
            return record
        updated = msgspec.structs.replace(
            record,
            status=status,
            updated_at=time.time(),
            reason=reason or record.reason,
            metrics=metrics if metrics is not None else record.metrics,
            policy_version=record.policy_version if policy_version is None else policy_version,
        )
        await put_job(self.jobs, updated, last=revision)
        if status != record.status:
            # A job enters each status once (accepted -> running -> a terminal one).
            await self._entered(updated, reason)
        return updated

    async def _state_event_stored(self, record: JobRecord) -> bool:
        """Whether the job's last ``StateChanged`` is the one for ``record.status`` (a
        handler run again long after the first, past the duplicate window, must not publish
        it twice)."""
        subject = subjects.event(record.tenant, record.job_id, "state")
        try:
            stored = await self.js.get_msg(subjects.STREAM_EVENTS, subject=subject)
            event = decode(EVENT_DECODER, stored.data or b"")
        except NotFoundError:
            return False
        except DecodeError:
            return True  # not ours to mend
        return isinstance(event, StateChanged) and event.status == record.status

    async def _entered(self, record: JobRecord, reason: str) -> None:
        """What follows a job's entering ``record.status``."""
        tenant, job_id, status = record.tenant, record.job_id, record.status
        self.admissions.noted(tenant, job_id, status, record.created_at)
        await publish_event(
            self.js, StateChanged(tenant, job_id, status, record.updated_at, reason), status
        )
        if status in TERMINAL_STATUSES and record.parent:
            await advance_pipeline(self, record)

    async def close_slot(self, tenant: str, job_id: str, reason: str) -> None:
        found = await self.record(tenant, job_id)
        if found is None:
            return
        spec = parse_job_spec(found[0].spec_json)
        if isinstance(spec, SFTJobSpec | RLJobSpec | SessionSpec):
            await publish(
                self.js,
                subjects.train(spec.backbone, tenant),
                CloseSlot(tenant, job_id, reason),
                message_id=msg_id("close", tenant, job_id),
                headers={headers.JOB_ID: job_id},
            )
        elif isinstance(spec, PipelineSpec):
            await end_stages(self, tenant, job_id, spec, reason)

    async def handle_event(self, msg: Msg) -> None:
        """Follow the trainer's and env workers' events of running jobs."""
        try:
            event = decode(EVENT_DECODER, msg.data)
        except DecodeError as exc:
            raise PoisonError(f"malformed event on {msg.subject}: {exc}") from exc
        match event:
            case PolicyPublished():
                await self.on_policy(event)
            case ErrorEvent(fatal=True):
                if await self.transition(
                    event.tenant, event.job_id, "failed", reason=event.message
                ):
                    await self.close_slot(event.tenant, event.job_id, "failed")
            case Metrics(iteration=-1):
                await self.transition(
                    event.tenant, event.job_id, "succeeded", metrics=dict(event.metrics)
                )
            case _:
                return

    async def on_policy(self, event: PolicyPublished) -> None:
        found = await self.record(event.tenant, event.job_id)
        if found is None or (found[0].status in TERMINAL_STATUSES and not event.final):
            return  # (a final one again may be a redelivery after a failure: transition redoes)
        policy = await self.policy_record(event.tenant, event.job_id)
        metrics = dict(policy.metrics) if policy else None
        if event.final:
            if await self.transition(
                event.tenant,
                event.job_id,
                "succeeded",
                metrics=metrics,
                policy_version=event.version,
            ):
                await self.close_slot(event.tenant, event.job_id, "succeeded")
            return
        await self.transition(
            event.tenant, event.job_id, "running", metrics=metrics, policy_version=event.version
        )
        spec = parse_job_spec(found[0].spec_json)
        if isinstance(spec, RLJobSpec):
            if policy is None:
                raise RetryableError(f"policy record of {event.tenant}/{event.job_id} not read")
            for task in rollout_tasks(event.job_id, spec, event.version, policy.slot):
                await publish(
                    self.js,
                    subjects.env(event.tenant, event.job_id),
                    task,
                    message_id=msg_id(
                        "rollout", event.tenant, event.job_id, task.iteration, task.first_episode
                    ),
                )

    async def policy_record(self, tenant: str, job_id: str) -> PolicyRecord | None:
        return await self.compiler.policy_record(tenant, job_id)

    async def fail(self, tenant: str, job_id: str, reason: str) -> None:
        if await self.transition(tenant, job_id, "failed", reason=reason):
            await self.close_slot(tenant, job_id, "failed")

    async def cancel(self, command: JobCancel) -> None:
        tracing.tag_job(command.tenant, command.job_id)
        if await self.record(command.tenant, command.job_id) is None:
            raise PoisonError(f"unknown job {command.tenant}/{command.job_id}")
        reason = command.reason or "cancelled by tenant"
        if await self.transition(command.tenant, command.job_id, "cancelled", reason=reason):
            await self.close_slot(command.tenant, command.job_id, "cancelled")

    async def on_dead(self, msg: Msg, reason: str, error: BaseException) -> None:
        """Answer a refused command's sender (:func:`services.master.commands.answer_refused`)."""
        await answer_refused(self, msg, reason)


async def run(config: MasterConfig) -> None:
    """Entry point: serve the master until SIGTERM/SIGINT."""

    async def body(rt: Runtime) -> None:
        watch = BackboneWatch(rt.js, config.backbones.split(","), config.backbone_deadline_s)
        datasets = Datasets(rt.js, config.dataset_cache_settings())
        master = Master(
            rt.js,
            await rt.js.key_value(subjects.KV_JOBS),
            await rt.js.key_value(subjects.KV_POLICIES),
            watch,
            EnvDescriptions(rt.nc, config.env_describe_timeout_s),
            config.limit,
            datasets=datasets,
        )
        # Tenants' requests (their jobs, datasets, exports) are answered beside the commands.
        queries = Queries(
            rt.js,
            master.jobs,
            master.policies,
            datasets.cache,
            limits=config.limit,
            pacer=Pacer(config.tenant_requests_per_s, config.tenant_request_burst),
        )
        await queries.subscribe(rt.nc)

        async def answer_state(msg: Msg) -> None:
            await msg.respond(encode(await master.state(queries.sessions.leases)))

        state_requests = await rt.nc.subscribe(MASTER_STATE_SUBJECT, cb=answer_state)
        commands = await rt.consumer.bind(
            ConsumerSpec(
                subjects.STREAM_JOBS,
                "master",
                f"{subjects.PREFIX}.job.>",
                max_deliver=config.max_deliver,
            ),
            on_dead=master.on_dead,
        )
        events = await rt.consumer.bind(
            ConsumerSpec(
                subjects.STREAM_EVENTS,
                "master-events",
                # Only the kinds handle_event acts on: a step's progress never reaches the master.
                tuple(f"{subjects.PREFIX}.event.*.*.{kind}" for kind in MASTER_EVENT_KINDS),
                max_deliver=config.max_deliver,
            )
        )
        rt.spawn(rt.consumer.run(events, master.handle_event), "master events")
        rt.spawn(watch.run(rt.stop, master.fail), "backbone watch")
        rt.spawn(master.admissions.run(rt.stop), "admissions")
        rt.spawn(sweep_every(rt.js, rt.stop), "object chunk sweep")
        rt.spawn(
            publish_queues(rt.nc, rt.stop, "master", rt.instance, "jobs", master.admissions.queue),
            "queue report",
        )
        try:
            await rt.consumer.run(commands, master.handle)
        finally:
            await state_requests.unsubscribe()
            await queries.close()

    await serve("master", config, body)
