"""What the master checks of a tenant's job command before it is planned: who the tenant is,
how many jobs it already runs, and whether its spec stays within the operator's bounds.

* **Registered tenants** (``tenants`` KV, :class:`~schemas.tenants.TenantRecord`, written by
  the operator): while the bucket holds no record (open mode: a stack without tenant
  identities, old stacks) every tenant is accepted; once any record exists, work from a
  tenant without one, or a revoked one, is refused with ``unknown tenant 'x'``.
* **What a tenant holds at once** (:class:`~schemas.tenants.TenantLimits`): running
  top-level jobs, trainer slots, simulator sessions (:func:`holding`). A job that would take
  the tenant past one of them is accepted and waits, ``queued`` with the reason
  (:meth:`TenantGate.wait_reason`); the master starts it when the tenant's running jobs leave
  room, oldest first. A job that could never fit (its own holding over a limit, a
  ``priority`` over ``max_job_priority``, an SFT commit interval over
  ``max_inflight_samples``) is refused, naming the limit (:func:`check_fits`). No limits in
  open mode. The master decides admissions one at a time (a lock), so counting and then
  starting cannot race another admission.
* **How it is served**: a job's weight on the trainer (DRR) and in inference batches is its
  tenant's priority class weight times its own ``priority``; an SFT stream keeps at most
  ``max_inflight_samples`` samples uncommitted (:func:`apply_limits`).
* **Spec bounds** (:class:`~schemas.limits.InputLimits`): the size of the command and its
  spec, and every field that makes a service allocate or loop (steps, iterations, batch
  size, episodes, envs, image size, views, token budget, head dims) — checked for every stage
  of a pipeline. The spec's static bounds (:mod:`schemas.specs`) hold for every stack; these
  are the operator's, tighter where a stack is smaller.

Every refusal is a :class:`~bus.errors.PoisonError`: the runtime dead-letters the command and
the tenant gets a ``rejected`` event with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, NotFoundError

from bus.codec import DecodeError, decode
from bus.errors import PoisonError
from bus.kv import kv_keys
from bus.records import list_jobs
from schemas import subjects
from schemas.env import StreamDataset
from schemas.jobs import TERMINAL_STATUSES, JobRecord
from schemas.limits import InputLimits, exceeds
from schemas.model import HeadConfig
from schemas.specs import (
    EvalJobSpec,
    HeadSpec,
    JobSpec,
    JobSpecError,
    PipelineSpec,
    RLJobSpec,
    SessionSpec,
    SFTJobSpec,
    parse_job_spec,
)
from schemas.tenants import TENANT_RECORD_DECODER, TenantLimits, TenantRecord
from services.master.plans import Plan


def check_size(what: str, size: int, limit: str, bound: int) -> None:
    """Refuse ``size`` bytes of ``what`` over ``bound``."""
    if size > bound:
        raise PoisonError(exceeds(what, f"{size} bytes", limit, bound))


def _at_most(field: str, value: int | None, limit: str, bound: int) -> None:
    if value is not None and value > bound:
        raise PoisonError(exceeds(field, value, limit, bound))


def check_planned_head(head: HeadConfig, limits: InputLimits) -> None:
    """Bound a planned head, whose dims the spec may have left to its dataset or env."""
    try:
        _head("", head, limits)
    except PoisonError as exc:
        raise PoisonError(f"{exc} (a dim the spec omits is its dataset's or env's)") from exc


def _head(prefix: str, head: HeadSpec | HeadConfig, limits: InputLimits) -> None:
    _at_most(f"{prefix}head.action_dim", head.action_dim, "max_action_dim", limits.max_action_dim)
    _at_most(f"{prefix}head.chunk_len", head.chunk_len, "max_chunk_len", limits.max_chunk_len)
    _at_most(
        f"{prefix}head.proprio_dim", head.proprio_dim, "max_proprio_dim", limits.max_proprio_dim
    )
    _at_most(f"{prefix}head.hidden_dim", head.hidden_dim, "max_hidden_dim", limits.max_hidden_dim)


def check_spec_bounds(spec: JobSpec, limits: InputLimits, prefix: str = "") -> None:
    """Raise :class:`PoisonError` naming the first field of ``spec`` over its limit."""
    match spec:
        case PipelineSpec():
            for i, stage in enumerate(spec.stages):
                check_spec_bounds(stage, limits, f"{prefix}stages.{i}.")
        case SFTJobSpec():
            _slot(prefix, spec, limits)
            _at_most(f"{prefix}steps", spec.steps, "max_steps", limits.max_steps)
            _at_most(
                f"{prefix}batch_size", spec.batch_size, "max_batch_size", limits.max_batch_size
            )
        case SessionSpec():
            _slot(prefix, spec, limits)
            _at_most(f"{prefix}max_calls", spec.max_calls, "max_steps", limits.max_steps)
        case RLJobSpec():
            _slot(prefix, spec, limits)
            _at_most(
                f"{prefix}iterations", spec.iterations, "max_iterations", limits.max_iterations
            )
            _at_most(
                f"{prefix}episodes_per_iteration",
                spec.episodes_per_iteration,
                "max_episodes",
                limits.max_episodes,
            )
            _rollouts(prefix, spec.parallel_envs, spec.max_episode_steps, spec.image_size, limits)
        case EvalJobSpec():
            _at_most(f"{prefix}episodes", spec.episodes, "max_episodes", limits.max_episodes)
            _rollouts(prefix, spec.parallel_envs, spec.max_episode_steps, spec.image_size, limits)


def _slot(prefix: str, spec: SFTJobSpec | RLJobSpec | SessionSpec, limits: InputLimits) -> None:
    """What every training spec asks of a trainer slot: its head, views and token budget."""
    _head(prefix, spec.head, limits)
    _at_most(f"{prefix}num_views", spec.num_views, "max_views", limits.max_views)
    _at_most(
        f"{prefix}token_budget", spec.token_budget, "max_token_budget", limits.max_token_budget
    )


#: Bytes of an episode's record besides its arrays (its other fields, its instruction, the
#: msgpack framing): a bound, not an estimate.
EPISODE_OVERHEAD = 8 << 10


def episode_bytes_bound(steps: int, head: HeadConfig, num_views: int, image_size: int) -> int:
    """The most bytes one episode's :class:`~schemas.train.RolloutBatch` can take: a
    transition per policy query (``chunk_len`` env steps, so at most ``ceil(steps /
    chunk_len)``), each with its views' uint8 pixels, its proprio, its action chunk and three
    floats (log-prob, value, reward)."""
    transitions = -(-steps // head.chunk_len)
    pixels = num_views * image_size * image_size * 3
    floats = head.proprio_dim + head.chunk_len * head.action_dim + 3
    return transitions * (pixels + 4 * floats) + EPISODE_OVERHEAD


def check_episode_bytes(spec: RLJobSpec, head: HeadConfig, limits: InputLimits) -> None:
    """Refuse an RL spec whose episodes could be over the trainer's ``max_message_bytes``
    (they would be run, then refused), or whose iteration's episodes together could be over
    ``max_iteration_bytes`` (the trainer holds them until the update); the message names the
    fields that set the size. An episode over the server's ``max_payload`` but within these
    bounds travels by reference (:mod:`bus.payloads`)."""
    size = episode_bytes_bound(spec.max_episode_steps, head, spec.num_views, spec.image_size)
    fields = (
        f"max_episode_steps {spec.max_episode_steps} x num_views {spec.num_views} x "
        f"image_size {spec.image_size}"
    )
    advice = ": lower one of them (or ask the operator for a larger limit)"
    if size > limits.max_message_bytes:
        raise PoisonError(
            exceeds(
                f"an episode of {fields}",
                f"up to {size} bytes",
                "max_message_bytes",
                limits.max_message_bytes,
            )
            + advice
        )
    episodes = spec.episodes_per_iteration
    if episodes * size > limits.max_iteration_bytes:
        raise PoisonError(
            exceeds(
                f"an iteration of episodes_per_iteration {episodes} episodes of {fields}",
                f"up to {episodes * size} bytes",
                "max_iteration_bytes",
                limits.max_iteration_bytes,
            )
            + advice
        )


def _rollouts(prefix: str, envs: int, steps: int, image_size: int, limits: InputLimits) -> None:
    _at_most(f"{prefix}parallel_envs", envs, "max_parallel_envs", limits.max_parallel_envs)
    _at_most(f"{prefix}max_episode_steps", steps, "max_episode_steps", limits.max_episode_steps)
    _at_most(f"{prefix}image_size", image_size, "max_image_side", limits.max_image_side)


class TenantGate:
    """Registered-tenant and concurrent-job checks against the ``tenants`` and ``jobs`` KV."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js

    async def record(self, tenant: str) -> TenantRecord | None:
        """The tenant's record; None if it has none. Raises ``unknown tenant`` when tenants
        are registered and this one is not, or is revoked."""
        registered = await kv_keys(self.js, subjects.KV_TENANTS)
        if not registered:
            return None  # open mode
        try:
            kv = await self.js.key_value(subjects.KV_TENANTS)
            entry = await kv.get(tenant)
            record = decode(TENANT_RECORD_DECODER, entry.value or b"")
        except (KeyNotFoundError, KeyDeletedError, BucketNotFoundError, NotFoundError):
            record = None
        except DecodeError as exc:
            raise PoisonError(
                f"tenant {tenant!r}: its tenant record is unreadable ({exc})"
            ) from exc
        if record is None:
            raise PoisonError(
                f"unknown tenant {tenant!r}: no identity is registered for it on this bus "
                f"(the operator adds one: joynexus tenant add {tenant})"
            )
        if record.revoked:
            raise PoisonError(f"unknown tenant {tenant!r}: its identity was revoked")
        return record

    async def wait_reason(
        self,
        tenant: str,
        job_id: str,
        spec: JobSpec,
        limits: TenantLimits,
        *,
        new: bool = False,
    ) -> str:
        """Why ``spec`` must wait for the tenant's running jobs ('' if it may start now):
        the first limit its holding would take the tenant past; for a ``new`` job also the
        tenant's queued jobs, which start first (oldest first: a flow of small new jobs
        would otherwise keep a larger queued one waiting for ever)."""
        records = [r for r in await list_jobs(self.js, tenant) if r.job_id != job_id]
        running = [r for r in records if r.status not in TERMINAL_STATUSES and r.status != "queued"]
        held = Holding(0, 0, 0)
        for record in running:
            held = held + holding_of(record)
        want = holding(spec)
        jobs = [r.job_id for r in running if not r.parent]
        if len(jobs) + 1 > limits.max_concurrent_jobs:
            return (
                f"tenant {tenant!r} has {len(jobs)} jobs running ({', '.join(jobs[:5])}); "
                f"its limit max_concurrent_jobs is {limits.max_concurrent_jobs}"
            )
        if held.slots + want.slots > limits.max_slots:
            return (
                f"tenant {tenant!r} holds {held.slots} trainer slots and this job needs "
                f"{want.slots}; its limit max_slots is {limits.max_slots}"
            )
        if held.env_sessions + want.env_sessions > limits.max_env_sessions:
            return (
                f"tenant {tenant!r} runs {held.env_sessions} simulator sessions and this job "
                f"needs {want.env_sessions}; its limit max_env_sessions is "
                f"{limits.max_env_sessions}"
            )
        queued = [r.job_id for r in records if r.status == "queued"]
        if new and queued:
            return (
                f"tenant {tenant!r} has {len(queued)} older jobs waiting to start "
                f"({', '.join(queued[:5])}); jobs start oldest first"
            )
        return ""


@dataclass(frozen=True)
class Holding:
    """What a running job holds of its tenant's limits."""

    jobs: int
    slots: int
    env_sessions: int

    def __add__(self, other: Holding) -> Holding:
        return Holding(
            self.jobs + other.jobs,
            self.slots + other.slots,
            self.env_sessions + other.env_sessions,
        )


def holding(spec: JobSpec) -> Holding:
    """A job's holding while it runs: a slot per training job; an RL job's iteration's
    episodes at once (every iteration that may run ahead with ``max_policy_lag``), an
    evaluation's ``parallel_envs``; a pipeline what its largest stage holds."""
    match spec:
        case PipelineSpec():
            stages = [holding(stage) for stage in spec.stages]
            return Holding(1, max(h.slots for h in stages), max(h.env_sessions for h in stages))
        case RLJobSpec():
            lag = spec.rl.max_policy_lag
            return Holding(1, 1, spec.episodes_per_iteration * (lag + 1))
        case SFTJobSpec() | SessionSpec():
            return Holding(1, 1, 0)
        case EvalJobSpec():
            sessions = min(spec.episodes, spec.parallel_envs) if spec.env else 0
            return Holding(1, 0, sessions)
    raise PoisonError(f"kind: {spec.kind!r} has no holding")


def holding_of(record: JobRecord) -> Holding:
    """A running job's holding from its record; a pipeline's stages count as their
    pipeline (which holds what its largest stage does), so they count nothing of their own."""
    if record.parent:
        return Holding(0, 0, 0)
    try:
        return holding(parse_job_spec(record.spec_json))
    except JobSpecError:  # recorded, so once valid: a spec of an older version
        return Holding(1, 0, 0)


def check_fits(spec: JobSpec, limits: TenantLimits, prefix: str = "") -> None:
    """Refuse (:class:`PoisonError`, naming the limit) a job that could never start under
    ``limits``, however long it waited."""
    want = holding(spec)
    if want.slots > limits.max_slots:
        raise PoisonError(
            exceeds(f"{prefix}job", f"{want.slots} slots", "max_slots", limits.max_slots)
        )
    if want.env_sessions > limits.max_env_sessions:
        raise PoisonError(
            exceeds(
                f"{prefix}job",
                f"{want.env_sessions} simulator sessions at once",
                "max_env_sessions",
                limits.max_env_sessions,
            )
        )
    match spec:
        case PipelineSpec():
            for i, stage in enumerate(spec.stages):
                check_fits(stage, limits, f"{prefix}stages.{i}.")
        case SFTJobSpec() | RLJobSpec() | SessionSpec():
            _at_most(
                f"{prefix}priority", spec.priority, "max_job_priority", limits.max_job_priority
            )
            if isinstance(spec, SFTJobSpec):
                # A stream must hold a whole commit interval (and one more batch) in flight.
                _at_most(
                    f"{prefix}checkpoint_every x batch_size",
                    (spec.checkpoint_every + 1) * spec.batch_size,
                    "max_inflight_samples",
                    limits.max_inflight_samples,
                )


def apply_limits(plan: Plan, limits: TenantLimits | None) -> Plan:
    """The plan as the tenant's limits serve it: its slot's weight times its class weight,
    its dataset stream's in-flight batches within ``max_inflight_samples``."""
    if limits is None or plan.open_slot is None:
        return plan
    slot = msgspec.structs.replace(plan.open_slot, priority=plan.open_slot.priority * limits.weight)
    tasks = []
    for task in plan.env_tasks:
        if isinstance(task, StreamDataset):
            batches = max(1, limits.max_inflight_samples // task.batch_size)
            task = msgspec.structs.replace(task, max_in_flight=min(task.max_in_flight, batches))
        tasks.append(task)
    return Plan(plan.backbone, slot, tasks)
