"""An env worker's simulators: the pool of sessions it keeps across tasks
(:class:`AdapterPool`) and what it measures of their calls (:class:`EnvMeter`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from bus.metering import BusyMeter
from bus.usage import UsageMeter
from services.envs.adapters import EnvAdapter, EnvUnavailableError, make_adapter

R = TypeVar("R")


@dataclass
class EnvStats:
    """One env id's work on this worker: counts and seconds, summed over its calls."""

    steps: int = 0
    step_s: float = 0.0
    #: Lockstep calls (each steps every live session through its chunk) and the sum of
    #: their squared seconds: how much a call's time varies.
    step_calls: int = 0
    step_s2: float = 0.0
    resets: int = 0
    reset_s: float = 0.0
    act_requests: int = 0
    act_observations: int = 0
    act_wait_s: float = 0.0
    episodes: int = 0
    tasks: int = 0
    #: Rollout and evaluation tasks from start to their records published.
    task_s: float = 0.0


@dataclass
class EnvMeter:
    """What an env worker measures of its simulators (heartbeat gauges). ``busy_s`` is the
    time any simulator call (reset, step) runs, counted once however many run at once; each
    env id's :class:`EnvStats` sum the calls' own durations, so under contention they add up
    to more than ``busy_s``."""

    sim: BusyMeter = field(default_factory=BusyMeter)
    envs: dict[str, EnvStats] = field(default_factory=dict)
    #: Each simulator call's seconds and steps, charged to the tenant it ran for (USAGE).
    usage: UsageMeter = field(default_factory=UsageMeter)

    @property
    def call_s(self) -> float:
        """Seconds of simulator calls, each counted whole (what the tenants are charged)."""
        return sum(s.step_s + s.reset_s for s in self.envs.values())

    def of(self, env_id: str) -> EnvStats:
        return self.envs.setdefault(env_id, EnvStats())

    async def simulate(self, call: Callable[[], R]) -> tuple[R, float]:
        """Run a blocking simulator call in a worker thread, metered; with its seconds."""
        t0 = time.perf_counter()
        with self.sim.busy():
            result = await asyncio.to_thread(call)
        return result, time.perf_counter() - t0

    def gauges(self) -> dict[str, float]:
        """``busy_s``, the totals over env ids, and each env id's as ``env.<id>.<name>``."""
        gauges = {"busy_s": self.sim.busy_s}
        for env_id, stats in self.envs.items():
            for name, value in dataclasses.asdict(stats).items():
                gauges[name] = gauges.get(name, 0.0) + float(value)
                gauges[f"env.{env_id}.{name}"] = float(value)
        return gauges


#: Idle simulator sessions an env worker keeps by default (its ``--max-idle-sessions``).
DEFAULT_MAX_IDLE = 64


class AdapterPool:
    """Simulator sessions are expensive to create (ManiSkill: seconds); keep and reuse them
    across tasks, keyed by (env id, image size, episode limit, env kwargs).

    At most ``max_idle`` are kept idle: past it the least recently used kinds' sessions are
    closed. Every tenant's choice of those values is a kind of its own, so kept without a
    bound a few short jobs (e.g. one episode limit each) filled the worker's memory."""

    def __init__(self, max_idle: int = DEFAULT_MAX_IDLE) -> None:
        if max_idle < 0:
            raise ValueError(f"max_idle must be >= 0, got {max_idle}")
        self.max_idle = max_idle
        #: Idle sessions by kind, the least recently used kind first.
        self.idle: OrderedDict[tuple[object, ...], list[EnvAdapter]] = OrderedDict()
        #: Sessions built so far, by env id.
        self.built: dict[str, int] = defaultdict(int)
        #: Idle sessions closed to stay within ``max_idle``.
        self.evicted = 0
        #: Sessions being built right now (seconds each: the worker is busy, not stalled).
        self.building = 0
        #: Told (and awaited) as a build starts: the service publishes a heartbeat saying so,
        #: because a simulator's first build in a process can hold the GIL — and the
        #: heartbeat loop with it — for 10-30 s (ManiSkill's native init, measured here).
        self.on_build: Callable[[], Awaitable[None]] | None = None

    @staticmethod
    def key(
        env_id: str, image_size: int, max_steps: int, env_kwargs: dict[str, Any] | None
    ) -> tuple[object, ...]:
        return (env_id, image_size, max_steps, tuple(sorted((env_kwargs or {}).items())))

    def _free(self, kind: tuple[object, ...]) -> list[EnvAdapter]:
        """The idle sessions of ``kind``, which becomes the most recently used."""
        free = self.idle.setdefault(kind, [])
        self.idle.move_to_end(kind)
        return free

    async def _trim(self) -> None:
        """Close idle sessions past ``max_idle``: the least recently used kinds' first, the
        oldest of a kind first (in a thread: a simulator's close can wait for its lock)."""
        excess = sum(len(free) for free in self.idle.values()) - self.max_idle
        if excess <= 0:
            return
        evicted: list[EnvAdapter] = []
        for kind in list(self.idle):
            free = self.idle[kind]
            take = min(excess - len(evicted), len(free))
            evicted += free[:take]
            del free[:take]
            if not free:
                del self.idle[kind]
            if len(evicted) >= excess:
                break
        if evicted:
            self.evicted += len(evicted)
            await asyncio.to_thread(_close_all, evicted)

    async def prewarm(
        self,
        env_id: str,
        image_size: int,
        max_steps: int,
        n: int,
        env_kwargs: dict[str, Any] | None = None,
    ) -> tuple[int, int]:
        """Build sessions (in a thread, one at a time) until ``n`` of this kind are idle;
        returns (idle now, built)."""
        kind = self.key(env_id, image_size, max_steps, env_kwargs)
        built = 0
        while len(self._free(kind)) < min(n, self.max_idle):
            adapter = await self._build(env_id, image_size, max_steps, env_kwargs or {})
            # Looked up again after the build: another task's trim may have dropped the list.
            self._free(kind).append(adapter)
            built += 1
        await self._trim()
        return len(self.idle.get(kind, ())), built

    async def _build(
        self, env_id: str, image_size: int, max_steps: int, env_kwargs: dict[str, Any]
    ) -> EnvAdapter:
        """One new session, built in a thread (seconds each for ManiSkill: the event loop,
        and the heartbeat, go on meanwhile); :attr:`building` counts those under way."""
        self.building += 1
        try:
            if self.on_build is not None:
                await self.on_build()
            reserved = sorted({"image_size", "max_episode_steps"} & env_kwargs.keys())
            if reserved:
                raise EnvUnavailableError(
                    f"env_kwargs: {', '.join(reserved)} is set by the job's own field of that "
                    "name, not an env_kwargs entry"
                )
            try:
                adapter = await asyncio.to_thread(
                    partial(
                        make_adapter,
                        env_id,
                        image_size=image_size,
                        max_episode_steps=max_steps,
                        **env_kwargs,
                    )
                )
            except (TypeError, ValueError) as exc:  # the env's constructor refused them
                raise EnvUnavailableError(
                    f"env {env_id} cannot be built with env_kwargs {env_kwargs}: {exc}"
                ) from exc
        finally:
            self.building -= 1
        self.built[env_id] += 1
        return adapter

    @asynccontextmanager
    async def sessions(
        self,
        env_id: str,
        image_size: int,
        max_steps: int,
        n: int,
        env_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[list[EnvAdapter]]:
        """``n`` sessions of this kind for one task: idle ones, and new ones built (see
        :meth:`_build`)."""
        kwargs = dict(env_kwargs or {})
        kind = self.key(env_id, image_size, max_steps, kwargs)
        free = self._free(kind)
        taken = [free.pop() for _ in range(min(n, len(free)))]
        try:
            while len(taken) < n:
                taken.append(await self._build(env_id, image_size, max_steps, kwargs))
            yield taken
        finally:
            self._free(kind).extend(taken)  # its list may have been trimmed away meanwhile
            await self._trim()

    def gauges(self) -> dict[str, float]:
        """Sessions built per env id, as ``env.<id>.sessions``; idle and evicted ones."""
        gauges = {f"env.{env_id}.sessions": float(n) for env_id, n in self.built.items()}
        gauges["sessions_idle"] = float(sum(len(free) for free in self.idle.values()))
        gauges["sessions_evicted"] = float(self.evicted)
        return gauges

    def close(self) -> None:
        for adapters in self.idle.values():
            for adapter in adapters:
                adapter.close()
        self.idle.clear()


def _close_all(adapters: list[EnvAdapter]) -> None:
    for adapter in adapters:
        adapter.close()
