"""Simulator sessions for RL rollouts and evaluation.

Sessions of one task step in lockstep: each step sends ONE act request with the observations
of every live session (so the inferencer sees a batch), then executes each session's action
chunk open-loop (a chunk is one macro-action; its rewards are summed). Episode ``e`` of
iteration ``i`` resets with seed ``seed + 100_003 * i + e`` and the sampling noise is seeded
per (task, step), so a re-run task reproduces its episodes under the same policy version.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from bus import tracing
from bus.inference import PolicyClient
from schemas.env import EvalTask, RolloutTask
from schemas.model import Observation
from schemas.tensor import Tensor
from schemas.train import RolloutBatch
from services.envs.adapters import (
    EnvAdapter,
    EnvRunError,
    StepObs,
    proprio_for_head,
)
from services.envs.pool import AdapterPool, EnvMeter, EnvStats

EPISODE_SEED_STRIDE = 100_003


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
