"""One interface over the simulators RL env workers drive: our gymnasium sims and ManiSkill3.

An :class:`EnvAdapter` turns any supported environment into the same per-step record, a
:class:`StepObs` (camera images, an instruction, a proprio vector), and takes a flat float
action. :func:`make_adapter` picks the adapter by environment id:

* ``JoyNexus/*`` ids (``services.envs.sims``) and any other gymnasium id whose observation is
  a dict with ``image`` / ``state`` (and optionally ``instruction``) -> :class:`GymDictAdapter`;
* the vetted ManiSkill3 tasks (``services.envs.maniskill.MANISKILL_TASKS``) ->
  ``services.envs.maniskill.ManiSkillAdapter``, which also says how ManiSkill is kept from
  prompting or downloading.

Building an adapter can cost seconds (ManiSkill), while ``reset`` costs milliseconds: a worker
should create one adapter per task it serves, keep it, and start every episode with
``reset(seed=...)`` instead of building a new adapter per episode. An adapter is not
thread-safe: drive each one from one thread at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from services.envs.sims import make_env, register_envs


class EnvUnavailableError(RuntimeError):
    """The environment cannot be built here: unknown id, missing assets or dependencies, or an
    observation layout no adapter understands. Not retryable: the same request fails again."""


class EnvRunError(RuntimeError):
    """An episode cannot go on: the simulator raised on reset or step, or the policy's
    actions cannot be applied (wrong shape, not finite). Not retryable: the same task with
    the same seeds and policy version fails the same way."""


class ProprioMismatchError(ValueError):
    """A head's ``proprio_dim`` that is neither the env's proprio dimension nor 0. Not
    retryable: the job's head does not fit its env."""


@dataclass
class StepObs:
    """What a policy sees at one step."""

    #: One uint8 ``(H, W, 3)`` image per camera view, in the adapter's view order.
    images: list[np.ndarray]
    #: The task instruction in natural language.
    instruction: str
    #: float32 ``(P,)`` proprioception; its layout is fixed per env id (see the adapter).
    proprio: np.ndarray


class EnvAdapter(Protocol):
    """A simulator session with a fixed action / observation layout."""

    env_id: str
    #: Length of the float action vector ``step`` takes.
    action_dim: int
    #: Length of ``StepObs.proprio``.
    proprio_dim: int
    #: Length of ``StepObs.images``.
    num_views: int

    def reset(self, seed: int) -> StepObs:
        """Start an episode; the same seed gives the same episode."""
        ...

    def step(self, action_A: np.ndarray) -> tuple[StepObs, float, bool, bool, dict[str, Any]]:
        """Apply ``action_A`` (clipped to the action space); return ``(obs, reward, terminated,
        truncated, info)`` with ``info["is_success"]`` a ``bool``."""
        ...

    def expert_action(self) -> np.ndarray | None:
        """The scripted expert's action in the current state, or ``None`` if there is none."""
        ...

    def privileged_state(self) -> dict[str, np.ndarray] | None:
        """True state a policy does not observe (object and goal positions: pretraining
        targets), by name, or ``None`` when the env exposes none."""
        ...

    def close(self) -> None:
        """Release the simulator."""
        ...


# -- our gymnasium sims (and other dict-observation gymnasium envs) ------------------------------


class GymDictAdapter:
    """Adapter for gymnasium envs with dict observations ``{"image", "state"[, "instruction"]}``.

    ``images`` is ``[obs["image"]]``, ``proprio`` is ``obs["state"]`` as float32, and the
    instruction is ``obs["instruction"]`` (or ``instruction`` when the env has none).
    ``expert_action`` calls ``env.unwrapped.expert_action()`` where the env defines it (our
    Reach2D sims do).

    Args:
        env_id: a registered gymnasium id (``JoyNexus/*`` ids are registered on import).
        max_episode_steps: time limit; ``None`` keeps the registered one.
        instruction: fallback instruction for envs whose observation has none.
        **env_kwargs: passed to ``gym.make`` (e.g. ``image_size=32`` for our sims).
    """

    def __init__(
        self,
        env_id: str,
        *,
        max_episode_steps: int | None = None,
        instruction: str = "",
        **env_kwargs: Any,
    ) -> None:
        if max_episode_steps is not None:
            env_kwargs["max_episode_steps"] = max_episode_steps
        self.env_id = env_id
        self.env: gym.Env[Any, Any] = make_env(env_id, **env_kwargs)
        obs_space = self.env.observation_space
        image = obs_space.get("image") if isinstance(obs_space, spaces.Dict) else None
        state = obs_space.get("state") if isinstance(obs_space, spaces.Dict) else None
        action = self.env.action_space
        if not (
            isinstance(image, spaces.Box)
            and image.dtype == np.uint8
            and len(image.shape) == 3
            and image.shape[2] == 3
            and isinstance(state, spaces.Box)
            and len(state.shape) == 1
            and isinstance(action, spaces.Box)
            and len(action.shape) == 1
        ):
            self.env.close()
            raise EnvUnavailableError(
                f"{env_id}: GymDictAdapter needs a Dict observation with a uint8 (H, W, 3) "
                f"'image' and a 1-D 'state' and a 1-D Box action; got observation "
                f"{obs_space} and action {action}"
            )
        self.image_shape: tuple[int, int, int] = (image.shape[0], image.shape[1], 3)
        self.action_dim = int(action.shape[0])
        self.proprio_dim = int(state.shape[0])
        self.num_views = 1
        self._low_A = action.low.astype(np.float32)
        self._high_A = action.high.astype(np.float32)
        self._default_instruction = instruction

    def reset(self, seed: int) -> StepObs:
        """Start an episode with ``seed``."""
        obs, _ = self.env.reset(seed=seed)
        return self._step_obs(obs)

    def step(self, action_A: np.ndarray) -> tuple[StepObs, float, bool, bool, dict[str, Any]]:
        """Clip ``action_A`` to the action space and step; see :meth:`EnvAdapter.step`."""
        obs, reward, terminated, truncated, info = self.env.step(
            clip_action(action_A, self._low_A, self._high_A)
        )
        info = {**info, "is_success": bool(info.get("is_success", False))}
        return self._step_obs(obs), float(reward), bool(terminated), bool(truncated), info

    def expert_action(self) -> np.ndarray | None:
        """The env's scripted expert (``env.unwrapped.expert_action()``), if it has one."""
        expert = getattr(self.env.unwrapped, "expert_action", None)
        if expert is None:
            return None
        return np.asarray(expert(), dtype=np.float32).reshape(self.action_dim)

    def privileged_state(self) -> dict[str, np.ndarray] | None:
        """The env's ``env.unwrapped.privileged_state()``, if it has one (Reach2D does)."""
        state = getattr(self.env.unwrapped, "privileged_state", None)
        return None if state is None else dict(state())

    def close(self) -> None:
        """Close the env."""
        self.env.close()

    def _step_obs(self, obs: Mapping[str, Any]) -> StepObs:
        # Copy the image: an env may draw the next frame into the same buffer.
        return StepObs(
            images=[np.array(obs["image"], dtype=np.uint8, copy=True)],
            instruction=str(obs.get("instruction", self._default_instruction)),
            proprio=np.asarray(obs["state"], dtype=np.float32).reshape(self.proprio_dim),
        )


def clip_action(action_A: np.ndarray, low_A: np.ndarray, high_A: np.ndarray) -> np.ndarray:
    """``action_A`` as float32 clipped to ``[low_A, high_A]``; ValueError if misshapen or not
    finite (a policy's bad output must not reach a simulator)."""
    action = np.asarray(action_A, dtype=np.float32)
    if action.shape != low_A.shape:
        raise ValueError(f"action must have shape {low_A.shape}, got {action.shape}")
    if not np.isfinite(action).all():
        raise ValueError(f"action must be finite, got {action}")
    return np.clip(action, low_A, high_A)


def proprio_for_head(proprio_P: np.ndarray, proprio_dim: int) -> np.ndarray:
    """The proprio a head of ``proprio_dim`` takes: all ``P`` entries, or none (0).

    Any other length is a ValueError, never a silent truncation: the master checks a job's
    head against the env's description at submit, so this is the last line of defence.
    """
    proprio_P = np.asarray(proprio_P, dtype=np.float32)
    if proprio_dim == 0:
        return proprio_P[..., :0]  # (P,) -> (0,), (B, P) -> (B, 0)
    if proprio_P.shape[-1] != proprio_dim:
        raise ProprioMismatchError(
            f"head.proprio_dim {proprio_dim} does not match the proprio dimension "
            f"{proprio_P.shape[-1]} (use {proprio_P.shape[-1]}, or 0 for none)"
        )
    return proprio_P


def time_limit(adapter: EnvAdapter) -> int | None:
    """The adapter's episode limit in steps (``None`` when its env has none)."""
    env: Any = getattr(adapter, "env", None)
    spec = getattr(env, "spec", None)
    limit = getattr(spec, "max_episode_steps", None)
    if not limit and adapter.env_id in gym.registry:  # ManiSkill's made env drops its spec's
        limit = gym.registry[adapter.env_id].max_episode_steps
    return int(limit) if limit else None


# -- choosing an adapter ------------------------------------------------------------------------


def make_adapter(
    env_id: str,
    *,
    image_size: int = 64,
    max_episode_steps: int | None = None,
    **kwargs: Any,
) -> EnvAdapter:
    """Build the adapter for ``env_id``.

    ``JoyNexus/*`` ids get a :class:`GymDictAdapter` rendering ``image_size`` images; ManiSkill
    tasks get a ``services.envs.maniskill.ManiSkillAdapter``; any other registered gymnasium id
    with a dict ``image`` / ``state`` observation gets a :class:`GymDictAdapter` (its images
    must already be ``image_size`` square). ``kwargs`` go to the adapter's constructor;
    ``proprio_extras`` only to a ManiSkill task's (elsewhere a non-empty one is refused).

    Raises:
        EnvUnavailableError: the id is unknown, its ManiSkill assets are missing, or ManiSkill is
            not installed; the message names the id and the supported ones.
    """
    register_envs()
    # Imported here: the ManiSkill module builds on this one's interface.
    from services.envs.maniskill import ManiSkillAdapter, is_maniskill_task

    if not is_maniskill_task(env_id) and kwargs.pop("proprio_extras", ""):
        raise ValueError(
            f"proprio_extras: {env_id} offers no task extras (ManiSkill cube tasks do); "
            "its proprio already carries what the task needs"
        )
    if env_id.startswith("JoyNexus/"):
        if env_id not in gym.registry:
            raise EnvUnavailableError(_unknown_message(env_id))
        return GymDictAdapter(
            env_id, max_episode_steps=max_episode_steps, image_size=image_size, **kwargs
        )
    if is_maniskill_task(env_id):
        return ManiSkillAdapter(
            env_id, image_size=image_size, max_episode_steps=max_episode_steps, **kwargs
        )
    if env_id in gym.registry:
        adapter = GymDictAdapter(env_id, max_episode_steps=max_episode_steps, **kwargs)
        if adapter.image_shape[:2] != (image_size, image_size):
            adapter.close()
            raise ValueError(
                f"{env_id} renders {adapter.image_shape[:2]} images, not {image_size}x{image_size}"
            )
        return adapter
    raise EnvUnavailableError(_unknown_message(env_id))


def _unknown_message(env_id: str) -> str:
    from services.envs.maniskill import MANISKILL_TASKS

    ours = sorted(i for i in gym.registry if i.startswith("JoyNexus/"))
    return (
        f"unknown env id {env_id!r}; supported: {', '.join(ours + list(MANISKILL_TASKS))} "
        "(or a registered gymnasium id with dict image/state observations)"
    )


__all__ = [
    "EnvAdapter",
    "EnvUnavailableError",
    "GymDictAdapter",
    "ProprioMismatchError",
    "StepObs",
    "clip_action",
    "make_adapter",
    "proprio_for_head",
    "time_limit",
]
