"""Asking an env worker what an environment looks like (core NATS request-reply).

The master (at submit) and the SDK (``Client.describe_env``) call :func:`request_description`;
an env worker answers (``services.envs.describe``). Neither caller builds a simulator.
"""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from bus.codec import DecodeError, decode, encode
from schemas import subjects
from schemas.envdesc import DESCRIBE_REPLY_DECODER, DescribeEnv, EnvDescription

#: How long to wait for an env worker's answer. A first ManiSkill build takes seconds; the
#: worker caches what it built, so a retry after a timeout is answered at once.
DEFAULT_TIMEOUT_S = 5.0


class EnvDescribeError(RuntimeError):
    """No description: ``retryable`` when no env worker answered in time (start one, or ask
    again), not when a worker said the env cannot be built (the message says why)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


async def request_description(
    nc: NATS,
    env_id: str,
    env_kwargs: dict[str, float | int | str | bool] | None = None,
    *,
    image_size: int = 64,
    timeout: float = DEFAULT_TIMEOUT_S,
    tenant: str | None = None,
) -> EnvDescription:
    """Ask the env workers to describe ``env_id`` built with ``env_kwargs``; a tenant's
    connection asks under its ``tenant`` token (its answer may go only to its own inbox).

    Raises:
        EnvDescribeError: no worker answered within ``timeout``, or it was busy building
            the tenant's other descriptions (retryable); or the worker could not build the env
            (not retryable; an unknown id names the supported ones).
    """
    request = DescribeEnv(env_id, dict(env_kwargs or {}), image_size)
    try:
        subject = subjects.env_describe(tenant)
        msg = await nc.request(subject, encode(request), timeout=timeout)
    except NoRespondersError as exc:
        raise EnvDescribeError(
            f"no env worker is running to describe env {env_id} (start the envs role)",
            retryable=True,
        ) from exc
    except (NatsTimeoutError, TimeoutError) as exc:
        raise EnvDescribeError(
            f"no env worker described env {env_id} within {timeout:g}s", retryable=True
        ) from exc
    try:
        reply = decode(DESCRIBE_REPLY_DECODER, msg.data)
    except DecodeError as exc:
        raise EnvDescribeError(f"malformed describe reply: {exc}", retryable=False) from exc
    if reply.description is None:
        raise EnvDescribeError(
            reply.error or f"env {env_id}: no description", retryable=reply.retryable
        )
    return reply.description
