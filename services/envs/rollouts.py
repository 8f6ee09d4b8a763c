"""Simulator sessions for RL rollouts and evaluation.

Sessions of one task step in lockstep: each step sends ONE act request with the observations
of every live session (so the inferencer sees a batch), then executes each session's action
chunk open-loop (a chunk is one macro-action; its rewards are summed). Episode ``e`` of
iteration ``i`` resets with seed ``seed + 100_003 * i + e`` and the sampling noise is seeded
per (task, step), so a re-run task reproduces its episodes under the same policy version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import zlib
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np

from bus import tracing
from bus.inference import PolicyClient
from bus.metering import BusyMeter
from bus.usage import UsageMeter
from schemas.env import EvalTask, RolloutTask
from schemas.model import Observation
from schemas.tensor import Tensor
from schemas.train import RolloutBatch
from services.envs.adapters import (
    EnvAdapter,
    EnvRunError,
    EnvUnavailableError,
    StepObs,
    make_adapter,
    proprio_for_head,
)

EPISODE_SEED_STRIDE = 100_003
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


class AdapterPool:
    """Simulator sessions are expensive to create (ManiSkill: seconds); keep and reuse them
    across tasks, keyed by (env id, image size, episode limit)."""

    def __init__(self) -> None:
        self.idle: dict[tuple[object, ...], list[EnvAdapter]] = defaultdict(list)
        #: Sessions built so far, by env id (none is ever dropped before close).
        self.built: dict[str, int] = defaultdict(int)
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
        free = self.idle[self.key(env_id, image_size, max_steps, env_kwargs)]
        built = 0
        while len(free) < n:
            free.append(await self._build(env_id, image_size, max_steps, env_kwargs or {}))
            built += 1
        return len(free), built

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
        free = self.idle[self.key(env_id, image_size, max_steps, kwargs)]
        taken = [free.pop() for _ in range(min(n, len(free)))]
        try:
            while len(taken) < n:
                taken.append(await self._build(env_id, image_size, max_steps, kwargs))
            yield taken
        finally:
            free.extend(taken)

    def gauges(self) -> dict[str, float]:
        """Sessions built per env id, as ``env.<id>.sessions``."""
        return {f"env.{env_id}.sessions": float(n) for env_id, n in self.built.items()}

    def close(self) -> None:
        for adapters in self.idle.values():
            for adapter in adapters:
                adapter.close()
        self.idle.clear()


def to_observation(obs: StepObs, num_views: int, proprio_dim: int) -> Observation:
    views = obs.images[:num_views]
    return Observation(
        images=[Tensor.from_numpy(np.ascontiguousarray(v)) for v in views],
        instruction=obs.instruction,
        proprio=Tensor.from_numpy(np.ascontiguousarray(proprio_for_head(obs.proprio, proprio_dim))),
    )


@dataclass
class Session:
    """One episode in progress: what the policy saw and did."""

    episode: int
    adapter: EnvAdapter
    obs: StepObs
    images: list[np.ndarray] = field(default_factory=list)
    proprio: list[np.ndarray] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    success: bool = False
    #: When its reset began and when it ended (epoch ns), for its span.
    started_ns: int = 0
    ended_ns: int = 0

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


#: Keeps the bootstrap request's seed apart from the steps' (:func:`bootstrap_values`).
BOOTSTRAP_SEED_TAG = 0x0B00


def step_seed(*parts: int) -> int:
    return zlib.crc32(np.asarray(parts, np.int64).tobytes()) & 0x7FFFFFFF


async def run_sessions(
    client: PolicyClient,
    tenant: str,
    job_id: str,
    adapters: list[EnvAdapter],
    episodes: list[tuple[int, int]],
    *,
    policy_version: int,
    deterministic: bool,
    num_views: int,
    token_budget: int,
    proprio_dim: int,
    noise_seed: int,
    meter: EnvMeter,
    stats: EnvStats,
    priority: int = 1,
) -> list[Session]:
    """Run ``episodes`` ((index, reset seed) pairs, at most one per adapter) to the end."""
    sessions = []
    for (index, seed), adapter in zip(episodes, adapters, strict=False):
        started_ns = time.time_ns()
        obs, seconds = await meter.simulate(partial(_reset, adapter, seed))
        stats.resets += 1
        stats.reset_s += seconds
        meter.usage.charge(tenant, job_id, compute_s=seconds)
        sessions.append(Session(index, adapter, obs, started_ns=started_ns))
    t = 0
    while live := [s for s in sessions if not s.done]:
        asked = time.perf_counter()
        reply = await client.act(
            tenant,
            job_id,
            [to_observation(s.obs, num_views, proprio_dim) for s in live],
            policy_version=policy_version,
            deterministic=deterministic,
            seed=step_seed(noise_seed, t),
            num_views=num_views,
            token_budget=token_budget,
            timeout=60.0,
            priority=priority,
        )
        stats.act_wait_s += time.perf_counter() - asked
        stats.act_requests += 1
        stats.act_observations += len(live)
        assert reply.actions is not None and reply.log_probs is not None
        actions_B_C_A = reply.actions.to_numpy()
        action_dim = live[0].adapter.action_dim
        if actions_B_C_A.ndim != 3 or actions_B_C_A.shape[::2] != (len(live), action_dim):
            raise EnvRunError(
                f"policy {job_id} v{reply.policy_version} answered {len(live)} observations "
                f"with actions of shape {actions_B_C_A.shape}; the env takes "
                f"({len(live)}, C, {action_dim})"
            )
        if not np.isfinite(actions_B_C_A).all():
            raise EnvRunError(
                f"policy {job_id} v{reply.policy_version} answered non-finite actions"
            )
        log_probs_B = reply.log_probs.to_numpy()
        values_B = reply.values.to_numpy() if reply.values is not None else None
        for b, session in enumerate(live):
            session.images.append(np.stack(session.obs.images[:num_views]))
            session.proprio.append(proprio_for_head(session.obs.proprio, proprio_dim))
            session.actions.append(actions_B_C_A[b])
            session.log_probs.append(float(log_probs_B[b]))
            session.values.append(float(values_B[b]) if values_B is not None else 0.0)
        steps, seconds = await meter.simulate(partial(_execute_chunks, live, actions_B_C_A))
        for session in live:
            if session.done:
                session.ended_ns = time.time_ns()
        stats.steps += steps
        stats.step_s += seconds
        meter.usage.charge(tenant, job_id, compute_s=seconds, env_steps=steps)
        stats.step_calls += 1
        stats.step_s2 += seconds * seconds
        t += 1
    stats.episodes += len(sessions)
    for session, (_, seed) in zip(sessions, episodes, strict=False):
        tracing.span_between(
            "episode",
            session.started_ns,
            session.ended_ns or time.time_ns(),
            attributes={
                **tracing.job_attributes(tenant, job_id),
                "joynexus.episode": session.episode,
                "joynexus.seed": seed,
                "joynexus.policy_version": policy_version,
                "joynexus.chunks": len(session.actions),
                "joynexus.return": float(sum(session.rewards)),
                "joynexus.success": session.success,
            },
        )
    return sessions


#: What a simulator raises for this machine, not for the task (out of memory, files or
#: devices): left to the consume loop to retry, perhaps on another worker.
_OURS = (MemoryError, OSError)


def _reset(adapter: EnvAdapter, seed: int) -> StepObs:
    try:
        return adapter.reset(seed)
    except _OURS:
        raise
    except Exception as exc:
        raise EnvRunError(f"the env raised on reset (seed {seed}): {exc!r}") from exc


def _execute_chunks(live: list[Session], actions_B_C_A: np.ndarray) -> int:
    """Each live session steps through its action chunk; returns the env steps taken."""
    steps = 0
    for b, session in enumerate(live):
        total = 0.0
        for action_A in actions_B_C_A[b]:
            try:
                obs, reward, terminated, truncated, info = session.adapter.step(action_A)
            except _OURS:
                raise
            except Exception as exc:
                raise EnvRunError(
                    f"episode {session.episode}: the env raised on step: {exc!r}"
                ) from exc
            steps += 1
            total += float(reward)
            session.obs = obs
            session.success = session.success or bool(info.get("is_success", False))
            if terminated or truncated:
                session.terminated, session.truncated = bool(terminated), bool(truncated)
                break
        session.rewards.append(total)
    return steps


def rollout_record(task: RolloutTask, session: Session, bootstrap_value: float) -> RolloutBatch:
    return RolloutBatch(
        tenant=task.tenant,
        job_id=task.job_id,
        iteration=task.iteration,
        episode=session.episode,
        policy_version=task.policy_version,
        images=Tensor.from_numpy(np.stack(session.images)),
        instruction=session.obs.instruction,
        proprio=Tensor.from_numpy(np.stack(session.proprio)),
        actions=Tensor.from_numpy(np.stack(session.actions).astype(np.float32)),
        log_probs=Tensor.from_numpy(np.asarray(session.log_probs, np.float32)),
        values=Tensor.from_numpy(np.asarray(session.values, np.float32)),
        rewards=Tensor.from_numpy(np.asarray(session.rewards, np.float32)),
        terminated=session.terminated,
        truncated=session.truncated and not session.terminated,
        success=session.success,
        bootstrap_value=bootstrap_value,
    )


async def collect(
    client: PolicyClient, pool: AdapterPool, task: RolloutTask, meter: EnvMeter
) -> list[RolloutBatch]:
    """Run the task's episodes and return their rollout records."""
    indices = list(range(task.first_episode, task.first_episode + task.episodes))
    records: list[RolloutBatch] = []
    width = max(1, task.parallel_envs)
    for start in range(0, len(indices), width):
        chunk = indices[start : start + width]
        base = task.seed + EPISODE_SEED_STRIDE * task.iteration
        seeds = [base if task.same_reset else base + e for e in chunk]
        async with pool.sessions(
            task.env_id, task.image_size, task.max_episode_steps, len(chunk), task.env_kwargs
        ) as adapters:
            sessions = await run_sessions(
                client,
                task.tenant,
                task.job_id,
                adapters,
                list(zip(chunk, seeds, strict=True)),
                policy_version=task.policy_version,
                deterministic=False,
                num_views=task.num_views,
                token_budget=task.token_budget,
                proprio_dim=task.proprio_dim,
                noise_seed=step_seed(task.seed, task.iteration, chunk[0]),
                meter=meter,
                stats=meter.of(task.env_id),
                priority=task.priority,
            )
        bootstrap = await bootstrap_values(client, task, sessions)
        records += [rollout_record(task, s, bootstrap.get(s.episode, 0.0)) for s in sessions]
    return records


async def bootstrap_values(
    client: PolicyClient, task: RolloutTask, sessions: list[Session]
) -> dict[int, float]:
    """V(s_T) of episodes cut off by the time limit (0 for real terminations).

    The request is seeded (the seed draws nothing: the actions are deterministic) so that the
    inferencer gives it a head call of its own: merged with another task's request into one
    larger call, the value head's matmuls can round differently, and V(s_T) — hence the
    advantages and the whole PPO update — would depend on what else was in the batch."""
    cut = [s for s in sessions if s.truncated and not s.terminated]
    if not cut:
        return {}
    reply = await client.act(
        task.tenant,
        task.job_id,
        [to_observation(s.obs, task.num_views, task.proprio_dim) for s in cut],
        policy_version=task.policy_version,
        deterministic=True,
        seed=step_seed(task.seed, task.iteration, cut[0].episode, BOOTSTRAP_SEED_TAG),
        num_views=task.num_views,
        token_budget=task.token_budget,
        timeout=60.0,
        priority=task.priority,
    )
    if reply.values is None:
        return {}
    values = reply.values.to_numpy()
    return {s.episode: float(values[i]) for i, s in enumerate(cut)}


async def evaluate_env(
    client: PolicyClient, pool: AdapterPool, task: EvalTask, meter: EnvMeter
) -> dict[str, Any]:
    """Deterministic episodes of a pinned policy version: success rate, return, length."""
    returns, lengths, successes = [], [], []
    width = max(1, task.parallel_envs)
    for start in range(0, task.episodes, width):
        chunk = list(range(start, min(task.episodes, start + width)))
        async with pool.sessions(
            task.env_id, task.image_size, task.max_episode_steps, len(chunk), task.env_kwargs
        ) as adapters:
            sessions = await run_sessions(
                client,
                task.tenant,
                task.policy_job,
                adapters,
                [(e, task.seed + e) for e in chunk],
                policy_version=task.policy_version,
                deterministic=True,
                num_views=task.num_views,
                token_budget=task.token_budget,
                proprio_dim=task.proprio_dim,
                noise_seed=task.seed,
                meter=meter,
                stats=meter.of(task.env_id),
            )
        returns += [sum(s.rewards) for s in sessions]
        lengths += [len(s.rewards) for s in sessions]
        successes += [s.success for s in sessions]
    return {
        "success_rate": float(np.mean(successes)),
        "mean_return": float(np.mean(returns)),
        "episode_length": float(np.mean(lengths)),
        "episodes": float(len(returns)),
        "policy_version": float(task.policy_version),
    }
