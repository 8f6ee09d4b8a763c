"""The master's planning: a job spec, checked against what it points at (its backbone, its
env, its dataset, the policy it starts from), becomes the :class:`~services.master.plans.Plan`
that starts it."""

from __future__ import annotations

from nats.js.kv import KeyValue

from bus import tracing
from bus.errors import PoisonError
from bus.records import get_job, get_policy
from schemas.limits import InputLimits
from schemas.specs import (
    EvalJobSpec,
    JobSpec,
    JobSpecError,
    PipelineSpec,
    RLJobSpec,
    SessionSpec,
    SFTJobSpec,
    parse_job_spec,
)
from schemas.tenants import TenantLimits
from schemas.train import PolicyRecord
from services.master.backbones import BackboneWatch
from services.master.envfit import EnvDescriptions, fit_env
from services.master.limits import apply_limits, check_episode_bytes, check_planned_head
from services.master.plans import (
    Datasets,
    Plan,
    compile_eval,
    compile_rl,
    compile_session,
    compile_sft,
)


class Compiler:
    """Compiles job specs into plans."""

    def __init__(
        self,
        policies: KeyValue,
        limits: InputLimits,
        backbones: BackboneWatch | None,
        envs: EnvDescriptions,
        datasets: Datasets,
        jobs: KeyValue | None = None,
    ) -> None:
        self.policies = policies
        #: The job records a policy's training spec (its backbone) is read from (None: not
        #: checked).
        self.jobs = jobs
        #: Operator bounds a plan's filled-in head is checked against.
        self.limits = limits
        #: Checks a spec's backbone at submit (None: any id is accepted).
        self.backbones = backbones
        #: Env descriptions a spec's head is checked against (asked of the env workers).
        self.envs = envs
        #: Resolves a spec's dataset id in its tenant's namespace.
        self.datasets = datasets

    async def compile(
        self, job_id: str, spec: JobSpec, limits: TenantLimits | None = None
    ) -> Plan | None:
        """The job's plan (None for a pipeline), served as its tenant's ``limits`` say."""
        attributes = {**tracing.job_attributes(spec.tenant, job_id), "joynexus.kind": spec.kind}
        with tracing.tracer().start_as_current_span("plan", attributes=attributes):
            plan = await self._compile(job_id, spec)
            return None if plan is None else apply_limits(plan, limits)

    async def _compile(self, job_id: str, spec: JobSpec) -> Plan | None:
        try:
            plan = await self._plan(job_id, spec)
        except JobSpecError as exc:  # e.g. a head whose dims, filled in, leave its bounds
            raise PoisonError(str(exc)) from exc
        if plan is not None and plan.open_slot is not None:
            # Dims the spec omits are filled in from its dataset or env: bound them too.
            check_planned_head(plan.open_slot.head, self.limits)
        return plan

    async def _plan(self, job_id: str, spec: JobSpec) -> Plan | None:
        if self.backbones is not None:
            for stage in spec.stages if isinstance(spec, PipelineSpec) else [spec]:
                await self.backbones.check(stage.backbone)
        spec = await fit_env(self.envs, spec, self.policy_record)
        match spec:
            case SFTJobSpec():
                init = await self.init_policy(spec, spec.init_from)
                return await compile_sft(job_id, spec, init, self.datasets, self.limits)
            case RLJobSpec():
                plan = compile_rl(job_id, spec, await self.init_policy(spec, spec.init_from))
                assert plan.open_slot is not None
                # Its episodes must fit the trainer's max_message_bytes (after the env filled in
                # the head's dims).
                check_episode_bytes(spec, plan.open_slot.head, self.limits)
                return plan
            case SessionSpec():
                init = await self.init_policy(spec, spec.init_from)
                return compile_session(job_id, spec, init)
            case EvalJobSpec():
                policy = await self.policy_record(spec.tenant, spec.policy_job)
                if policy is None:
                    raise PoisonError(
                        f"policy_job: job {spec.policy_job!r} of tenant {spec.tenant!r} has "
                        "no committed policy"
                    )
                await self.check_backbone(spec, spec.policy_job, "policy_job")
                return await compile_eval(job_id, spec, policy, self.datasets, self.limits)
            case PipelineSpec():
                return None
        raise PoisonError(f"kind: {spec.kind!r} cannot be planned")

    async def init_policy(
        self, spec: SFTJobSpec | RLJobSpec | SessionSpec, job_id: str | None
    ) -> PolicyRecord | None:
        if job_id is None:
            return None
        record = await self.policy_record(spec.tenant, job_id)
        if record is None:
            raise PoisonError(f"init_from: job {job_id!r} has no committed policy to start from")
        await self.check_backbone(spec, job_id, "init_from")
        return record

    async def check_backbone(
        self, spec: SFTJobSpec | RLJobSpec | SessionSpec | EvalJobSpec, job_id: str, field: str
    ) -> None:
        """A policy runs on the backbone that trained it: its head reads that backbone's
        features. On another backbone of another width every request fails; of the same
        width its actions, and an eval's metrics, are silently wrong. A job whose record is
        gone (removed) is not checked."""
        if self.jobs is None:
            return
        record, _ = await get_job(self.jobs, spec.tenant, job_id)
        if record is None:
            return
        try:
            trained = parse_job_spec(record.spec_json)
        except JobSpecError:
            return  # a record of an older spec format: nothing to compare with
        backbone = getattr(trained, "backbone", None)
        if backbone is not None and backbone != spec.backbone:
            raise PoisonError(
                f"backbone: {spec.backbone!r}, but {field} {job_id!r} was trained on "
                f"{backbone!r} (a head reads only the features of the backbone it learnt on)"
            )

    async def policy_record(self, tenant: str, job_id: str) -> PolicyRecord | None:
        record, _ = await get_policy(self.policies, tenant, job_id)
        return record
