"""Frames with what the simulator knows about them: the data of backbone pretraining
(:mod:`vla.pretrain`).

The scripted expert drives each episode, with a share of its actions replaced by random
ones so the tool and objects take poses a clean demonstration never shows; every step's
camera frames are kept with the env's privileged state (object, goal and tool positions,
:meth:`~services.envs.adapters.EnvAdapter.privileged_state`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from services.envs.adapters import make_adapter, time_limit
from vla.pretrain import FrameSet


def collect_frames(
    env_id: str,
    episodes: int,
    seed: int,
    *,
    image_size: int = 64,
    random_action_share: float = 0.3,
    on_episode: Callable[[int], None] | None = None,
) -> FrameSet:
    """Render ``episodes`` episodes of ``env_id`` (episode ``i`` from ``seed + i``).

    Raises:
        ValueError: the env has no scripted expert or no privileged state to learn from.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    if not 0.0 <= random_action_share <= 1.0:
        raise ValueError(f"random_action_share must be in [0, 1], got {random_action_share}")
    adapter = make_adapter(env_id, image_size=image_size)
    try:
        limit = time_limit(adapter) or 50
        rng = np.random.default_rng(seed)
        images: list[np.ndarray] = []
        instructions: list[str] = []
        targets: list[np.ndarray] = []
        sizes: dict[str, int] = {}
        for episode in range(episodes):
            obs = adapter.reset(seed=seed + episode)
            for _ in range(limit):
                state = adapter.privileged_state()
                expert_A = adapter.expert_action()
                if state is None or expert_A is None:
                    raise ValueError(
                        f"{env_id} has no {'privileged state' if state is None else 'expert'} "
                        "to pretrain on"
                    )
                names = tuple(sorted(state))
                sizes = {name: int(np.asarray(state[name]).size) for name in names}
                images.append(np.stack(obs.images))
                instructions.append(obs.instruction)
                targets.append(np.concatenate([state[name].reshape(-1) for name in names]))
                action_A = expert_A
                if rng.random() < random_action_share:
                    action_A = rng.uniform(-1.0, 1.0, adapter.action_dim).astype(np.float32)
                obs, _, terminated, truncated, _ = adapter.step(action_A)
                if terminated or truncated:
                    break
            if on_episode is not None:
                on_episode(episode)
    finally:
        adapter.close()
    columns = tuple(
        f"{name}[{i}]" if size > 1 else name for name, size in sizes.items() for i in range(size)
    )
    return FrameSet(
        np.stack(images),
        instructions,
        np.stack(targets).astype(np.float32),
        columns,
        (env_id,),
    )
