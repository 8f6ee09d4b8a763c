"""Describing environments: what a policy's head must match, read off a real simulator.

:func:`describe_env` builds the env once (ManiSkill: seconds) and returns its
:class:`~schemas.envdesc.EnvDescription`: action space (dim, bounds, control mode), proprio
layout and dim, cameras and image sizes, episode limit and instruction. :class:`Describer`
answers :class:`~schemas.envdesc.DescribeEnv` requests on :data:`schemas.subjects.ENV_DESCRIBE`
for an env worker, caching one description per (env id, env kwargs, image size), so the
master and the SDK never need a simulator.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from bus.auth import query_reply_allowed
from bus.codec import DecodeError, decode, encode
from schemas import subjects
from schemas.envdesc import (
    DESCRIBE_REQUEST_DECODER,
    ActionSpace,
    Camera,
    DescribeEnv,
    DescribeReply,
    EnvDescription,
    ProprioPart,
)
from schemas.limits import InputLimits
from services.envs.adapters import (
    EnvAdapter,
    EnvUnavailableError,
    GymDictAdapter,
    make_adapter,
    time_limit,
)

log = logging.getLogger(__name__)

EnvKwargs = dict[str, float | int | str | bool]
#: Longest env id (and env_kwargs key) a describe request may name.
MAX_ENV_ID_CHARS = 200
#: Most constructor arguments a describe request may pass.
MAX_ENV_KWARGS = 32
#: Descriptions kept (the least recently asked for dropped past it).
MAX_CACHED = 256
#: Builds one tenant's requests may have waiting or under way at once; more are answered
#: "busy" (retryable), so one tenant's flood cannot queue the others' (and the master's).
MAX_BUILDS_PER_TENANT = 2


class DescribeBusy(Exception):
    """The tenant has :data:`MAX_BUILDS_PER_TENANT` builds in hand already."""


def describe_adapter(adapter: EnvAdapter, env_kwargs: EnvKwargs | None = None) -> EnvDescription:
    """The description of a built adapter (a :class:`GymDictAdapter` or a ManiSkill one)."""
    # Imported here: ManiSkill's module is only needed (and importable) where it is used.
    from services.envs.maniskill import ManiSkillAdapter

    env: Any = adapter.env  # type: ignore[attr-defined]
    limit = time_limit(adapter)
    low = [float(v) for v in adapter._low_A]  # type: ignore[attr-defined]
    high = [float(v) for v in adapter._high_A]  # type: ignore[attr-defined]
    if isinstance(adapter, ManiSkillAdapter):
        control_mode = adapter.control_mode
        layout = [
            ProprioPart(k, n)
            for k, n in zip(adapter.proprio_keys, adapter.proprio_sizes, strict=True)
        ]
        cameras = [Camera(c, adapter.image_size, adapter.image_size) for c in adapter.cameras]
        instruction = adapter.instruction
        extras = [ProprioPart(n, size) for n, size in adapter.available_extras.items()]
    elif isinstance(adapter, GymDictAdapter):
        base = env.unwrapped
        control_mode = str(getattr(base, "control_mode", "") or "unspecified")
        names = getattr(base, "state_layout", None)
        layout = (
            [ProprioPart(str(n), 1) for n in names]
            if names is not None and len(names) == adapter.proprio_dim
            else [ProprioPart("state", adapter.proprio_dim)]
        )
        height, width, _ = adapter.image_shape
        cameras = [Camera("image", height, width)]
        instruction = getattr(base, "instruction_template", None) or adapter.reset(0).instruction
        extras = []
    else:
        raise EnvUnavailableError(f"{adapter.env_id}: no description for {type(adapter).__name__}")
    return EnvDescription(
        env_id=adapter.env_id,
        action=ActionSpace(adapter.action_dim, low, high, control_mode),
        proprio_dim=adapter.proprio_dim,
        proprio_layout=layout,
        cameras=cameras,
        max_episode_steps=int(limit or 0),
        instruction=str(instruction),
        env_kwargs=dict(env_kwargs or {}),
        proprio_extras=extras,
    )


def describe_env(
    env_id: str, env_kwargs: EnvKwargs | None = None, image_size: int = 64
) -> EnvDescription:
    """Build ``env_id`` with ``env_kwargs``, describe it and close it (seconds for ManiSkill).

    Raises:
        EnvUnavailableError: unknown id (the message names the supported ones), missing
            assets or ManiSkill.
        ValueError / TypeError: constructor arguments the env refuses.
    """
    kwargs: dict[str, Any] = dict(env_kwargs or {})
    adapter = make_adapter(env_id, image_size=image_size, **kwargs)
    try:
        return describe_adapter(adapter, env_kwargs)
    finally:
        adapter.close()


def cache_key(env_id: str, env_kwargs: EnvKwargs, image_size: int) -> str:
    """One cache entry per (env id, constructor arguments, image size)."""
    return json.dumps([env_id, sorted(env_kwargs.items()), image_size])


def format_description(d: EnvDescription) -> str:
    """Human-readable lines for ``joynexus env describe``."""
    bounds = ", ".join(
        f"[{lo:g}, {hi:g}]" for lo, hi in zip(d.action.low, d.action.high, strict=True)
    )
    layout = ", ".join(p.name if p.size == 1 else f"{p.name}[{p.size}]" for p in d.proprio_layout)
    cameras = ", ".join(f"{c.name} {c.height}x{c.width}" for c in d.cameras)
    extras = (
        ", ".join(f"{p.name}[{p.size}]" for p in d.proprio_extras)
        + ' (add to the proprio: env_kwargs {"proprio_extras": "name,name"})'
        if d.proprio_extras
        else "none"
    )
    lines = [
        f"env:           {d.env_id}",
        f"env_kwargs:    {json.dumps(d.env_kwargs, sort_keys=True)}",
        f"action:        dim {d.action.dim}, control mode {d.action.control_mode}",
        f"action bounds: {bounds}",
        f"proprio:       dim {d.proprio_dim}: {layout}",
        f"task extras:   {extras}",
        f"cameras:       {len(d.cameras)}: {cameras}",
        f"episode limit: {d.max_episode_steps} steps",
        f"instruction:   {d.instruction}",
        f"head:          action_dim: {d.action.dim}, proprio_dim: {d.proprio_dim} (or 0)",
    ]
    return "\n".join(lines)


class Describer:
    """Answers describe requests for an env worker: one build per distinct request, cached.

    Builds run one at a time in a thread of their own, one per key (concurrent requests for
    the same key wait for the same build): the threads that step tenants' simulators are
    never taken by describes. A failed build is not cached, so a fixed env is seen at once.
    A tenant has at most :data:`MAX_BUILDS_PER_TENANT` builds in hand; the last
    :data:`MAX_CACHED` descriptions asked for are kept.
    """

    def __init__(self, limits: InputLimits | None = None) -> None:
        self.limits = limits or InputLimits()
        self.cache: OrderedDict[str, EnvDescription] = OrderedDict()
        self._building: dict[str, asyncio.Future[EnvDescription]] = {}
        #: Builds each tenant's requests started and are waiting for.
        self._tenant_builds: dict[str, int] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="describe")
        self._replies: set[asyncio.Task[None]] = set()
        self._subs: list[Subscription] = []
        #: Awaited as a build starts (the worker's heartbeat says it is building: see
        #: :attr:`services.envs.pool.AdapterPool.on_build`).
        self.on_build: Callable[[], Awaitable[None]] | None = None

    @property
    def building(self) -> int:
        """Descriptions being built right now."""
        return len(self._building)

    async def describe(self, request: DescribeEnv, tenant: str | None = None) -> EnvDescription:
        """``request``'s description: cached, or built (``tenant``: whose request starts the
        build, held to :data:`MAX_BUILDS_PER_TENANT`; None: a service's, never held)."""
        key = cache_key(request.env_id, request.env_kwargs, request.image_size)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        build = self._building.get(key)
        if build is None:
            if tenant is not None:
                if self._tenant_builds.get(tenant, 0) >= MAX_BUILDS_PER_TENANT:
                    raise DescribeBusy(
                        f"{MAX_BUILDS_PER_TENANT} descriptions for tenant {tenant} are being "
                        "built already: ask again when one is answered"
                    )
                self._tenant_builds[tenant] = self._tenant_builds.get(tenant, 0) + 1
            build = asyncio.ensure_future(self._build(request))
            self._building[key] = build
            build.add_done_callback(lambda _: self._built(key, tenant))
        description = await asyncio.shield(build)
        self.cache[key] = description
        self.cache.move_to_end(key)
        while len(self.cache) > MAX_CACHED:
            self.cache.popitem(last=False)
        return description

    def _built(self, key: str, tenant: str | None) -> None:
        self._building.pop(key, None)
        if tenant is not None:
            left = self._tenant_builds.pop(tenant, 1) - 1
            if left > 0:
                self._tenant_builds[tenant] = left

    async def _build(self, request: DescribeEnv) -> EnvDescription:
        if self.on_build is not None:
            await self.on_build()
        build = partial(describe_env, request.env_id, request.env_kwargs, request.image_size)
        return await asyncio.get_running_loop().run_in_executor(self._executor, build)

    async def reply(self, request_data: bytes, tenant: str | None = None) -> DescribeReply:
        """The reply to one encoded request (``tenant``: the requester's, from its subject);
        every failure becomes an ``error`` reply."""
        try:
            request = decode(DESCRIBE_REQUEST_DECODER, request_data)
        except DecodeError as exc:
            return DescribeReply(error=f"malformed describe request: {exc}")
        refused = self.refusal(request)
        if refused:
            return DescribeReply(error=f"env {request.env_id[:200]}: {refused}")
        try:
            return DescribeReply(description=await self.describe(request, tenant))
        except DescribeBusy as exc:
            return DescribeReply(error=f"env {request.env_id[:200]}: {exc}", retryable=True)
        except (EnvUnavailableError, ValueError, TypeError) as exc:
            return DescribeReply(error=f"env {request.env_id}: {exc}")
        except Exception as exc:  # noqa: BLE001 - any env's constructor may raise anything
            # A tenant's request for an env that cannot be built gets its reason, whatever
            # the env's own error type (gymnasium's NameNotFound, a simulator's RuntimeError).
            return DescribeReply(error=f"env {request.env_id[:200]}: {type(exc).__name__}: {exc}")

    def refusal(self, request: DescribeEnv) -> str:
        """Why ``request`` is not even tried ('' if it may be): an env id or kwargs past
        what any env takes, or images outside [8, ``max_image_side``]."""
        limits = self.limits
        if not 1 <= len(request.env_id) <= MAX_ENV_ID_CHARS:
            return f"env_id: length {len(request.env_id)} is not within 1..{MAX_ENV_ID_CHARS}"
        if not 8 <= request.image_size <= limits.max_image_side:
            return (
                f"image_size: {request.image_size} is not within 8..max_image_side "
                f"{limits.max_image_side}"
            )
        if len(request.env_kwargs) > MAX_ENV_KWARGS:
            return f"env_kwargs: {len(request.env_kwargs)} keys, at most {MAX_ENV_KWARGS} allowed"
        for key, value in request.env_kwargs.items():
            if len(key) > MAX_ENV_ID_CHARS or (isinstance(value, str) and len(value) > 1024):
                return f"env_kwargs: key or value of {key[:40]!r} is too long"
        return ""

    async def _answer(self, msg: Msg) -> None:
        if not query_reply_allowed(msg.subject, subjects.ENV_DESCRIBE, msg.reply):
            # No answer, and no build: a reply named outside the sender's own inbox would
            # publish the description there (a stream's subject, another tenant's inbox).
            log.info("describe request with reply %r (not its inbox) dropped", msg.reply[:80])
            return
        tenant = None if msg.subject == subjects.ENV_DESCRIBE else msg.subject.rsplit(".", 1)[1]
        reply = await self.reply(msg.data, tenant)
        try:
            await msg.respond(encode(reply))
        except NatsError as exc:  # the connection closed meanwhile: the requester times out
            log.info("describe reply for %s not sent: %s", reply.description or reply.error, exc)

    async def _on_request(self, msg: Msg) -> None:
        # A reply of its own per request: a ManiSkill build must not hold up cached answers.
        task = asyncio.create_task(self._answer(msg))
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)

    async def subscribe(self, nc: NATS) -> None:
        """Start answering :data:`schemas.subjects.ENV_DESCRIBE` and its per-tenant form in
        the env workers' queue group (one worker answers each request)."""
        self._subs = [
            await nc.subscribe(subject, queue=subjects.ENV_DESCRIBE_QUEUE, cb=self._on_request)
            for subject in (subjects.ENV_DESCRIBE, f"{subjects.ENV_DESCRIBE}.*")
        ]

    async def close(self) -> None:
        """Stop answering. A build in progress is left to finish in its thread; its reply
        is dropped with the connection (the requester times out and asks again)."""
        subs, self._subs = self._subs, []
        for sub in subs:
            await sub.unsubscribe()
        self._executor.shutdown(wait=False, cancel_futures=True)


__all__ = [
    "Describer",
    "cache_key",
    "describe_adapter",
    "describe_env",
    "format_description",
]
