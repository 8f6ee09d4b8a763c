"""Recording a simulator's scripted expert as a dataset (the format is :mod:`vla.data`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from services.envs.sims import make_env
from vla.data import DatasetError, DatasetInfo, EpisodeRecord, write_dataset


def record(
    env_id: str,
    episodes: int,
    out_dir: str | os.PathLike[str],
    seed: int,
    max_steps: int | None = None,
    *,
    env_kwargs: Mapping[str, Any] | None = None,
    camera: str = "front",
    overwrite: bool = False,
) -> DatasetInfo:
    """Record ``episodes`` episodes of the env's scripted expert as a dataset at ``out_dir``.

    Episode ``i`` starts from ``env.reset(seed=seed + i)``, so a dataset is reproducible from
    ``(env_id, env_kwargs, seed)``. The env must return dict observations with ``image``
    (uint8 HxWx3, stored as camera ``camera``), ``state`` and ``instruction`` (the task), and
    its unwrapped env must have ``expert_action() -> action``. ``max_steps`` replaces the
    env's registered time limit. Each frame stores the observation and the one action taken
    there; success comes from the final ``info["is_success"]``.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    kwargs = dict(env_kwargs or {})
    if max_steps is not None:
        kwargs["max_episode_steps"] = max_steps
    env = make_env(env_id, **kwargs)
    try:
        expert: Callable[[], np.ndarray] | None = getattr(env.unwrapped, "expert_action", None)
        if expert is None:
            raise DatasetError(f"{env_id} has no scripted expert (env.unwrapped.expert_action)")
        limit = max_steps or (env.spec.max_episode_steps if env.spec else None)
        if limit is None:
            raise ValueError(f"{env_id} has no time limit; pass max_steps")
        fps = int(env.metadata.get("render_fps") or 10)

        def run(episode_index: int) -> EpisodeRecord:
            obs, info = env.reset(seed=seed + episode_index)
            if not isinstance(obs, Mapping) or not {"image", "state"} <= obs.keys():
                raise DatasetError(f"{env_id}: record needs dict observations with image, state")
            task = str(obs.get("instruction") or env_id)
            states, actions, images = [], [], []
            for _ in range(limit):
                action = np.asarray(expert(), dtype=np.float32)
                states.append(obs["state"])
                images.append(obs["image"])
                actions.append(action)
                obs, _, terminated, truncated, info = env.step(action)
                if terminated or truncated:
                    break
            success = info.get("is_success")
            return EpisodeRecord(
                task=task,
                state_T_S=np.stack(states).astype(np.float32),
                action_T_A=np.stack(actions),
                images={camera: np.stack(images)},
                success=None if success is None else bool(success),
            )

        return write_dataset(
            out_dir,
            (run(i) for i in range(episodes)),
            fps,
            robot_type=env_id,
            env_id=env_id,
            source="scripted_expert",
            overwrite=overwrite,
        )
    finally:
        env.close()
