"""Jobs that fit their env: a spec's head checked against the env's description at submit.

The master never builds a simulator: it asks an env worker (:func:`bus.envinfo.
request_description`) and caches the answer per (env id, env kwargs, image size). An RL
spec's omitted ``head.action_dim`` / ``head.proprio_dim`` are filled from the env; a given
one that does not match is rejected naming both numbers. ``proprio_dim`` is the env's or 0
(no proprio): nothing is ever truncated. No worker answering is retryable (the submit is
redelivered, then rejected with that reason); an env no worker can build is not.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS

from bus.envinfo import EnvDescribeError, request_description
from bus.errors import PoisonError, RetryableError
from schemas.envdesc import EnvDescription
from schemas.model import HeadConfig
from schemas.specs import EvalJobSpec, JobSpec, RLJobSpec
from schemas.train import PolicyRecord

#: Nak delay of a submit that found no env worker to describe its env.
RETRY_DELAY_S = 2.0
#: How long the master waits for a description: an env worker builds the env the first time
#: (a ManiSkill scene takes ~20 s on a loaded 2-core machine); later answers are cached.
DESCRIBE_TIMEOUT_S = 20.0


class EnvDescriptions:
    """Env descriptions asked over the bus, cached for the master's lifetime (an env's
    layout is fixed by its id and constructor arguments)."""

    def __init__(self, nc: NATS, timeout_s: float = DESCRIBE_TIMEOUT_S) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        self.cache: dict[str, EnvDescription] = {}

    async def get(
        self, env_id: str, env_kwargs: dict[str, float | int | str | bool], image_size: int
    ) -> EnvDescription:
        """The description; RetryableError if no worker answered, PoisonError if the env
        cannot be built."""
        key = json.dumps([env_id, sorted(env_kwargs.items()), image_size])
        if key not in self.cache:
            try:
                self.cache[key] = await request_description(
                    self.nc, env_id, env_kwargs, image_size=image_size, timeout=self.timeout_s
                )
            except EnvDescribeError as exc:
                if exc.retryable:
                    raise RetryableError(f"env: {exc}", delay_s=RETRY_DELAY_S) from exc
                raise PoisonError(f"env: {exc}") from exc
        return self.cache[key]


def check_head_fits(head: HeadConfig, num_views: int, env: EnvDescription, where: str) -> None:
    """PoisonError naming the field, its value and the env's, if ``head`` does not fit."""
    if head.action_dim != env.action.dim:
        raise PoisonError(
            f"{where}action_dim: {head.action_dim} does not match env {env.env_id}'s action "
            f"dimension {env.action.dim}"
        )
    if head.proprio_dim not in (0, env.proprio_dim):
        raise PoisonError(
            f"{where}proprio_dim: {head.proprio_dim} does not match env {env.env_id}'s proprio "
            f"dimension {env.proprio_dim} (use {env.proprio_dim}, or 0 for none)"
        )
    if num_views > len(env.cameras):
        raise PoisonError(
            f"num_views: {num_views} but env {env.env_id} has {len(env.cameras)} camera(s)"
        )


async def fit_env(
    envs: EnvDescriptions,
    spec: JobSpec,
    policy_of: Callable[[str, str], Awaitable[PolicyRecord | None]],
) -> JobSpec:
    """``spec`` with an RL head's omitted dims filled from its env, after checking that the
    head (an eval's: its policy's) fits the env. Other specs are returned unchanged."""
    if isinstance(spec, RLJobSpec):
        env = await envs.get(spec.env, dict(spec.env_kwargs), spec.image_size)
        head = spec.head.filled(env.action.dim, env.proprio_dim)
        check_head_fits(head.to_config(), spec.num_views, env, "head.")
        return spec.model_copy(update={"head": head})
    if isinstance(spec, EvalJobSpec) and spec.env is not None:
        policy = await policy_of(spec.tenant, spec.policy_job)
        if policy is None:
            return spec  # compiling the eval rejects it, naming the policy job
        env = await envs.get(spec.env, dict(spec.env_kwargs), spec.image_size)
        where = f"policy_job {spec.policy_job!r}: head."
        check_head_fits(policy.slot.head, policy.slot.num_views, env, where)
    return spec
