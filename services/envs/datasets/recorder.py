"""Recording a simulator's scripted expert as a dataset (the format is :mod:`vla.data`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from services.envs.adapters import EnvAdapter, make_adapter, time_limit
from vla.data import DatasetError, DatasetInfo, EpisodeRecord, write_dataset

#: Default frames per second written to a dataset whose env does not say.
_DEFAULT_FPS = 10


def record(
    env_id: str,
    episodes: int,
    out_dir: str | os.PathLike[str],
    seed: int,
    max_steps: int | None = None,
    *,
    env_kwargs: Mapping[str, Any] | None = None,
    camera: str = "front",
    only_success: bool = False,
    max_attempts: int | None = None,
    on_episode: Callable[[int, bool], None] | None = None,
    overwrite: bool = False,
) -> DatasetInfo:
    """Record ``episodes`` episodes of the env's scripted expert as a dataset at ``out_dir``.

    Any env with a scripted expert works: our sims (``JoyNexus/*``, their image stored as
    camera ``camera``) and the ManiSkill tasks of :mod:`services.envs.experts` (every camera
    the adapter renders, under ManiSkill's sensor names). Each frame stores the camera images,
    the proprio the env gives a policy (``observation.state``) and the expert's action there;
    each episode its task instruction and the env's final ``is_success``.

    Attempt ``i`` starts from ``reset(seed=seed + i)``, so a dataset is reproducible from
    ``(env_id, env_kwargs, seed)``. With ``only_success`` failed attempts are dropped and
    recording goes on until ``episodes`` succeeded, at most ``max_attempts`` (default
    ``2 * episodes + 10``) attempts. ``max_steps`` replaces the env's time limit;
    ``env_kwargs`` go to :func:`~services.envs.adapters.make_adapter` (``image_size``, ...).
    ``on_episode(attempt, success)`` is called after each attempt (a progress bar).

    Raises:
        DatasetError: the env has no scripted expert, or too few attempts succeeded.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    attempts = max_attempts if max_attempts is not None else 2 * episodes + 10
    if attempts < episodes:
        raise ValueError(f"max_attempts {attempts} is below episodes {episodes}")
    adapter = make_adapter(env_id, max_episode_steps=max_steps, **dict(env_kwargs or {}))
    try:
        limit = max_steps or time_limit(adapter)
        if limit is None:
            raise ValueError(f"{env_id} has no time limit; pass max_steps")
        reset_obs = adapter.reset(seed=seed)
        if adapter.expert_action() is None:
            raise DatasetError(f"{env_id} has no scripted expert for its control mode")
        cameras: tuple[str, ...] = tuple(getattr(adapter, "cameras", None) or (camera,))
        if len(cameras) != len(reset_obs.images):
            raise DatasetError(f"{env_id}: {len(reset_obs.images)} images for cameras {cameras}")
        metadata = getattr(getattr(adapter, "env", None), "metadata", None) or {}
        fps = int(metadata.get("render_fps") or _DEFAULT_FPS)

        def kept() -> Iterator[EpisodeRecord]:
            recorded = 0
            for attempt in range(attempts):
                episode = _run_expert(adapter, seed + attempt, limit, cameras)
                if on_episode is not None:
                    on_episode(attempt, bool(episode.success))
                if only_success and not episode.success:
                    continue
                yield episode
                recorded += 1
                if recorded == episodes:
                    return
            raise DatasetError(
                f"{env_id}: only {recorded} of {attempts} expert episodes succeeded, "
                f"{episodes} asked for"
            )

        return write_dataset(
            out_dir,
            kept(),
            fps,
            robot_type=env_id,
            env_id=env_id,
            source="scripted_expert",
            overwrite=overwrite,
        )
    finally:
        adapter.close()


def _run_expert(
    adapter: EnvAdapter, seed: int, limit: int, cameras: tuple[str, ...]
) -> EpisodeRecord:
    """One episode of the adapter's expert from ``reset(seed)``, at most ``limit`` steps."""
    obs = adapter.reset(seed=seed)
    task = obs.instruction or adapter.env_id
    states, actions = [], []
    frames: list[list[np.ndarray]] = [[] for _ in cameras]
    success = False
    for _ in range(limit):
        action = adapter.expert_action()
        if action is None:
            raise DatasetError(f"{adapter.env_id}: the expert gave no action mid-episode")
        states.append(obs.proprio)
        for view, image in zip(frames, obs.images, strict=True):
            view.append(image)
        actions.append(np.asarray(action, dtype=np.float32))
        obs, _, terminated, truncated, info = adapter.step(action)
        success = bool(info["is_success"])
        if terminated or truncated:
            break
    return EpisodeRecord(
        task=task,
        state_T_S=np.stack(states).astype(np.float32),
        action_T_A=np.stack(actions),
        images={name: np.stack(view) for name, view in zip(cameras, frames, strict=True)},
        success=success,
    )
