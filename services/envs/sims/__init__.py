"""Simulators of our own, registered with gymnasium on import.

``import services.envs.sims`` registers ``JoyNexus/Reach2D-v0``; :func:`make_env` builds any
registered gymnasium id (ours or a third party's) after making sure ours exist.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

REACH2D_ID = "JoyNexus/Reach2D-v0"
#: Reach2D with a gripper command as a third action dimension ("reach and grasp").
REACH_GRASP_ID = "JoyNexus/ReachGrasp2D-v0"
#: Reach2D's time limit; ``make_env(REACH2D_ID, max_episode_steps=n)`` overrides it.
REACH2D_MAX_STEPS = 50


def register_envs() -> None:
    """Register our gymnasium ids; a no-op for ids already registered (safe to call again)."""
    if REACH2D_ID not in gym.registry:
        gym.register(
            id=REACH2D_ID,
            entry_point="services.envs.sims.reach:Reach2DEnv",
            max_episode_steps=REACH2D_MAX_STEPS,
        )
    if REACH_GRASP_ID not in gym.registry:
        gym.register(
            id=REACH_GRASP_ID,
            entry_point="services.envs.sims.reach:Reach2DEnv",
            max_episode_steps=REACH2D_MAX_STEPS,
            kwargs={"gripper": True},
        )


def make_env(env_id: str, **kwargs: Any) -> gym.Env[Any, Any]:
    """``gym.make(env_id, **kwargs)`` with our ids registered first.

    ``kwargs`` go to ``gym.make``: the env's constructor arguments (e.g. ``image_size=32``)
    and gymnasium's own (``max_episode_steps``, ``render_mode``, ``disable_env_checker``).
    """
    register_envs()
    return gym.make(env_id, **kwargs)


register_envs()

__all__ = ["REACH2D_ID", "REACH2D_MAX_STEPS", "REACH_GRASP_ID", "make_env", "register_envs"]
