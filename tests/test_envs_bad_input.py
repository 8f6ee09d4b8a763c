"""What the env worker does with what the tenant controls and the service cannot fix: env
kwargs the env refuses, a simulator that raises, a policy whose actions cannot be applied.
Each fails its task at its first delivery with a PoisonError naming the problem (before, most
escaped as errors of ours: retried max_deliver times with backoff, then failed as
``gave up after 5 deliveries: TypeError: ...``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from nats.js import JetStreamContext

from bus.codec import encode
from bus.datacache import DatasetCache
from bus.errors import PoisonError
from schemas import subjects
from schemas.env import EvalTask, RolloutTask
from schemas.infer import ActReply
from schemas.tensor import Tensor
from services.envs.datasets import record
from services.envs.service import EnvWorker
from services.envs.sims import REACH2D_ID
from services.envs.sims.reach import Reach2DEnv
from tests.helpers import uid
from tests.sft_helpers import registered


@dataclass
class _Msg:
    subject: str
    data: bytes


class _Policy:
    """Answers every act request, with actions a real policy could never give in some modes."""

    def __init__(self, mode: str = "ok", action_dim: int = 2, chunk_len: int = 2) -> None:
        self.mode, self.action_dim, self.chunk_len = mode, action_dim, chunk_len

    async def act(self, tenant: str, job_id: str, observations: list[Any], **kw: Any) -> ActReply:
        rows = len(observations) - (self.mode == "fewer_rows")
        dim = self.action_dim + (self.mode == "wrong_dim")
        actions = np.zeros((rows, self.chunk_len, dim), np.float32)
        if self.mode == "nan":
            actions[:] = np.nan
        log_probs = np.zeros(rows, np.float32)
        return ActReply("r", 1, Tensor.from_numpy(actions), Tensor.from_numpy(log_probs))


class _Exploding(gym.Env[dict[str, np.ndarray], np.ndarray]):
    """A simulator that raises at its third step: the physics (the task's fault), or out of
    memory or files (this machine's)."""

    def __init__(self, image_size: int = 64, error: str = "physics") -> None:
        self.error = error
        self.observation_space = spaces.Dict(
            {
                "image": spaces.Box(0, 255, (image_size, image_size, 3), np.uint8),
                "state": spaces.Box(-1, 1, (4,), np.float32),
            }
        )
        self.action_space = spaces.Box(-1, 1, (2,), np.float32)
        self.steps = 0

    def _obs(self) -> dict[str, np.ndarray]:
        shape = self.observation_space["image"].shape
        return {"image": np.zeros(shape, np.uint8), "state": np.zeros(4, np.float32)}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        self.steps = 0
        return self._obs(), {}

    def step(
        self, action: np.ndarray
    ) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        self.steps += 1
        if self.steps >= 3:
            if self.error == "memory":
                raise MemoryError("no room for the contact buffer")
            if self.error == "files":
                raise OSError(24, "Too many open files")
            raise RuntimeError("physics exploded")
        return self._obs(), 0.0, False, False, {}


EXPLODING_ID = "JoyNexusTest/Exploding-v0"
gym.register(id=EXPLODING_ID, entry_point=_Exploding, max_episode_steps=50)


def _rollout(tenant: str, **fields: Any) -> RolloutTask:
    task: dict[str, Any] = {
        "tenant": tenant,
        "job_id": uid("job"),
        "backbone": "tiny",
        "env_id": REACH2D_ID,
        "iteration": 0,
        "first_episode": 0,
        "episodes": 2,
        "policy_version": 1,
        "seed": 0,
        "max_episode_steps": 10,
        "proprio_dim": 4,
        "parallel_envs": 2,
    }
    return RolloutTask(**{**task, **fields})


async def _handle(worker: EnvWorker, task: RolloutTask | EvalTask) -> None:
    msg = _Msg(subjects.env(task.tenant, task.job_id), encode(task))
    await asyncio.wait_for(worker.handle(msg), 60)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "fields", "message"),
    [
        ("nan", {}, r"policy .* v1 answered non-finite actions"),
        ("wrong_dim", {}, r"answered 2 observations with actions of shape \(2, 2, 3\); the env"),
        ("fewer_rows", {}, r"answered 2 observations with actions of shape \(1, 2, 2\)"),
        ("ok", {"env_id": EXPLODING_ID}, r"episode 0: the env raised on step: .*physics exploded"),
        ("ok", {"env_kwargs": {"max_episode_steps": 5}}, r"env_kwargs: max_episode_steps is set"),
        ("ok", {"env_kwargs": {"no_such": 1}}, r"cannot be built with env_kwargs .*no_such"),
        ("ok", {"env_kwargs": {"min_start_distance": 5.0}}, r"min_start_distance must be in"),
    ],
    ids=[
        "nan",
        "wrong-dim",
        "fewer-rows",
        "env-raises",
        "reserved-kwarg",
        "unknown-kwarg",
        "unsatisfiable-kwarg",
    ],
)
async def test_a_task_the_tenant_cannot_run_fails_at_once_naming_why(
    js: JetStreamContext, policy: str, fields: dict[str, Any], message: str
) -> None:
    worker = EnvWorker(js, {"tiny": _Policy(policy)})  # type: ignore[dict-item]
    try:
        with pytest.raises(PoisonError, match=message):
            await _handle(worker, _rollout(uid("acme"), **fields))
    finally:
        worker.pool.close()


async def test_an_eval_on_a_dataset_refuses_non_finite_policy_actions(
    js: JetStreamContext, tmp_path: Path
) -> None:
    """Before, the eval succeeded with NaN metrics."""
    record(REACH2D_ID, 6, tmp_path / "reach", seed=0)
    tenant = uid("acme")
    dataset = await registered(js, tenant, tmp_path / "reach")
    task = EvalTask(
        tenant=tenant,
        job_id=uid("eval"),
        backbone="tiny",
        policy_job="trained",
        policy_version=1,
        episodes=1,
        seed=0,
        dataset=dataset,
        proprio_dim=4,
        chunk_len=2,
        val_fraction=0.5,
    )
    worker = EnvWorker(js, {"tiny": _Policy("nan")}, dataset_cache=DatasetCache(tmp_path / "cache"))  # type: ignore[dict-item]
    with pytest.raises(PoisonError, match=r"policy trained v1 answered non-finite actions"):
        await _handle(worker, task)


def test_reach_refuses_a_start_distance_no_reset_can_meet() -> None:
    with pytest.raises(ValueError, match=r"min_start_distance must be in \[0, 1.0\].*got 5.0"):
        Reach2DEnv(min_start_distance=5.0)
    env = Reach2DEnv(min_start_distance=1.0)  # the farthest allowed: every reset finds one
    for seed in range(20):
        env.reset(seed=seed)
    crowded = Reach2DEnv(num_distractors=3, dot_radius=0.9)
    with pytest.raises(RuntimeError, match=r"4 dots of dot_radius 0.9 do not fit"):
        crowded.reset(seed=0)  # placing them used to loop for ever


@pytest.mark.parametrize(("error", "raised"), [("memory", MemoryError), ("files", OSError)])
async def test_a_simulator_out_of_memory_or_files_is_ours_to_retry_not_the_tenants_fault(
    js: JetStreamContext, error: str, raised: type[Exception]
) -> None:
    worker = EnvWorker(js, {"tiny": _Policy()})  # type: ignore[dict-item]
    try:
        task = _rollout(uid("acme"), env_id=EXPLODING_ID, env_kwargs={"error": error})
        with pytest.raises(raised) as caught:
            await _handle(worker, task)
        assert not isinstance(caught.value, PoisonError)
    finally:
        worker.pool.close()
