"""What the master checks of a tenant's job command before it is planned: who the tenant is,
how many jobs it already runs, and whether its spec stays within the operator's bounds.

* **Registered tenants** (``tenants`` KV, :class:`~schemas.tenants.TenantRecord`, written by
  the operator): while the bucket holds no record (open mode: a stack without tenant
  identities, old stacks) every tenant is accepted; once any record exists, work from a
  tenant without one, or a revoked one, is refused with ``unknown tenant 'x'``.
* **Concurrent jobs**: a submit while the tenant has ``limits.max_concurrent_jobs`` top-level
  jobs that are not terminal is refused, naming the limit (a pipeline's stages belong to
  their pipeline and do not count again). No limit in open mode. One master consumes the
  JOBS stream at a time, so counting and then accepting cannot race another submit.
* **Spec bounds** (:class:`~schemas.limits.InputLimits`): the size of the command and its
  spec, and every field that makes a service allocate or loop (steps, iterations, batch
  size, episodes, envs, image size, views, token budget, head dims) — checked for every stage
  of a pipeline. The spec's static bounds (:mod:`schemas.specs`) hold for every stack; these
  are the operator's, tighter where a stack is smaller.

Every refusal is a :class:`~bus.errors.PoisonError`: the runtime dead-letters the command and
the tenant gets a ``rejected`` event with the reason.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, NotFoundError

from bus.codec import DecodeError, decode
from bus.errors import PoisonError
from bus.kv import kv_keys
from bus.records import list_jobs
from schemas import subjects
from schemas.jobs import TERMINAL_STATUSES
from schemas.limits import InputLimits, exceeds
from schemas.specs import (
    EvalJobSpec,
    HeadSpec,
    JobSpec,
    PipelineSpec,
    RLJobSpec,
    SessionSpec,
    SFTJobSpec,
)
from schemas.tenants import TENANT_RECORD_DECODER, TenantRecord


def check_size(what: str, size: int, limit: str, bound: int) -> None:
    """Refuse ``size`` bytes of ``what`` over ``bound``."""
    if size > bound:
        raise PoisonError(exceeds(what, f"{size} bytes", limit, bound))


def _at_most(field: str, value: int | None, limit: str, bound: int) -> None:
    if value is not None and value > bound:
        raise PoisonError(exceeds(field, value, limit, bound))


def _head(prefix: str, head: HeadSpec, limits: InputLimits) -> None:
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
        if record is None or record.revoked:
            raise PoisonError(f"unknown tenant {tenant!r}")
        return record

    async def admit(self, tenant: str, job_id: str) -> None:
        """Refuse a new job of an unknown tenant, or past its ``max_concurrent_jobs``."""
        record = await self.record(tenant)
        if record is None:
            return
        limit = record.limits.max_concurrent_jobs
        running = [
            r.job_id
            for r in await list_jobs(self.js, tenant)
            if r.status not in TERMINAL_STATUSES and not r.parent and r.job_id != job_id
        ]
        if len(running) >= limit:
            raise PoisonError(
                f"tenant {tenant!r} already has {len(running)} jobs running "
                f"({', '.join(running[:5])}); its limit max_concurrent_jobs is {limit}"
            )
