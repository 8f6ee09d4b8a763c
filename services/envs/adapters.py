"""One interface over the simulators RL env workers drive: our gymnasium sims and ManiSkill3.

An :class:`EnvAdapter` turns any supported environment into the same per-step record, a
:class:`StepObs` (camera images, an instruction, a proprio vector), and takes a flat float
action. :func:`make_adapter` picks the adapter by environment id:

* ``JoyNexus/*`` ids (``services.envs.sims``) and any other gymnasium id whose observation is
  a dict with ``image`` / ``state`` (and optionally ``instruction``) -> :class:`GymDictAdapter`;
* the vetted ManiSkill3 tasks in :data:`MANISKILL_TASKS` -> :class:`ManiSkillAdapter` (CPU
  physics, software-Vulkan rendering; ``scripts/setup-maniskill.sh`` installs both).

Creating a ManiSkill env costs seconds (importing ManiSkill ~5-10 s, the first env in a process
compiles shaders), while ``reset`` costs tens of milliseconds. A worker should therefore create
one adapter per task it serves, keep it, and start every episode with ``reset(seed=...)``
instead of building a new adapter per episode. An adapter is not thread-safe: drive each one
from one thread at a time.

ManiSkill never reads stdin through these adapters: its asset-download prompt is switched off
(``MS_SKIP_ASSET_DOWNLOAD_PROMPT=1``), tasks whose assets are missing are refused before the
env is built (:class:`EnvUnavailableError`, nothing is downloaded at run time), and stdin is
``/dev/null`` while ManiSkill is imported and envs are built.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from services.envs.sims import make_env, register_envs


class EnvUnavailableError(RuntimeError):
    """The environment cannot be built here: unknown id, missing assets or dependencies, or an
    observation layout no adapter understands. Not retryable: the same request fails again."""


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
            _clip(action_A, self._low_A, self._high_A)
        )
        info = {**info, "is_success": bool(info.get("is_success", False))}
        return self._step_obs(obs), float(reward), bool(terminated), bool(truncated), info

    def expert_action(self) -> np.ndarray | None:
        """The env's scripted expert (``env.unwrapped.expert_action()``), if it has one."""
        expert = getattr(self.env.unwrapped, "expert_action", None)
        if expert is None:
            return None
        return np.asarray(expert(), dtype=np.float32).reshape(self.action_dim)

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


# -- ManiSkill3 --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ManiSkillTask:
    """How we run one vetted ManiSkill task."""

    #: The instruction given to the policy (ManiSkill tasks have none of their own).
    instruction: str
    #: Default controller: end-effector position deltas where the robot has them.
    control_mode: str


#: ManiSkill3 tasks the adapter is vetted on (all use robots bundled with the mani-skill wheel,
#: so none needs a download). Measured action / proprio dims with the default control mode:
#: PushCube 4/25, PickCube 4/29, PullCube 4/28, StackCube 4/25, PickCubeSO100 6/23, PushT 3/21.
MANISKILL_TASKS: dict[str, ManiSkillTask] = {
    "PushCube-v1": ManiSkillTask("push the cube to the goal region", "pd_ee_delta_pos"),
    "PickCube-v1": ManiSkillTask("pick up the cube and move it to the goal", "pd_ee_delta_pos"),
    "PullCube-v1": ManiSkillTask("pull the cube to the goal region", "pd_ee_delta_pos"),
    "StackCube-v1": ManiSkillTask("stack the red cube on the green cube", "pd_ee_delta_pos"),
    # The SO100 arm has joint controllers only.
    "PickCubeSO100-v1": ManiSkillTask(
        "pick up the cube and move it to the goal", "pd_joint_delta_pos"
    ),
    "PushT-v1": ManiSkillTask("push the T-shaped block onto the T-shaped goal", "pd_ee_delta_pos"),
}

# Deprecation warnings ManiSkill 3.0.1 raises on every use and that no caller can avoid:
# it converts each action to a torch tensor and then calls ``np.isnan`` on it (NumPy 2 warns),
# and some task builders call ``logging.Logger.warn``. Silenced only around ManiSkill calls.
_MANISKILL_DEPRECATIONS = (
    r"__array_wrap__ must accept context and return_scalar",
    r"The 'warn' method is deprecated",
)


@contextlib.contextmanager
def _maniskill_call() -> Iterator[None]:
    """Around calls into ManiSkill: its known deprecation warnings silenced, stdin at EOF."""
    with _stdin_closed(), warnings.catch_warnings():
        for message in _MANISKILL_DEPRECATIONS:
            warnings.filterwarnings("ignore", message, DeprecationWarning)
        yield


def maniskill_asset_dir() -> Path:
    """Where ManiSkill keeps downloaded assets: ``$MS_ASSET_DIR`` if the operator set it, else
    ``$JOYNEXUS_HOME/maniskill``, else ``~/.joynexus/maniskill``."""
    if explicit := os.environ.get("MS_ASSET_DIR"):
        return Path(explicit)
    home = os.environ.get("JOYNEXUS_HOME")
    return (Path(home) if home else Path.home() / ".joynexus") / "maniskill"


@contextlib.contextmanager
def _stdin_closed() -> Iterator[None]:
    """``sys.stdin`` reads EOF: a prompt we did not foresee fails at once instead of waiting."""
    saved = sys.stdin
    with open(os.devnull, encoding="utf-8") as devnull:
        sys.stdin = devnull
        try:
            yield
        finally:
            sys.stdin = saved


def _import_maniskill() -> None:
    """Import ManiSkill (registering its envs with gymnasium) with our environment settings.

    ManiSkill reads ``MS_ASSET_DIR`` once, at import, so this must run before anything else
    imports it.
    """
    if "mani_skill.envs" in sys.modules:
        return
    if importlib.util.find_spec("mani_skill") is None:
        raise EnvUnavailableError(
            "ManiSkill is not installed: run `bash scripts/setup-maniskill.sh .venv` "
            "(the Makefile's install step does)"
        )
    # With this set ManiSkill answers its own download prompt "yes" instead of reading stdin;
    # asset-needing tasks are refused before they get there (``_missing_maniskill_assets``).
    os.environ["MS_SKIP_ASSET_DOWNLOAD_PROMPT"] = "1"
    os.environ["MS_ASSET_DIR"] = str(maniskill_asset_dir())
    with _maniskill_call():
        import mani_skill.envs  # noqa: F401  (registers the tasks)


def _is_maniskill_id(env_id: str) -> bool:
    from mani_skill.utils.registration import REGISTERED_ENVS

    return env_id in REGISTERED_ENVS


def _missing_maniskill_assets(env_id: str) -> list[str]:
    """Asset ids the task needs that are not on disk (ManiSkill's own check, without its
    download prompt)."""
    from mani_skill.utils import assets
    from mani_skill.utils.registration import REGISTERED_ENVS

    missing: list[str] = []
    for asset_id in REGISTERED_ENVS[env_id].asset_download_ids or []:
        ids = (
            assets.expand_data_group_into_individual_data_source_ids(asset_id)
            if asset_id in assets.DATA_GROUPS
            else [asset_id]
        )
        missing += [i for i in ids if not assets.is_data_source_downloaded(i)]
    return missing


class ManiSkillAdapter:
    """Adapter for a vetted ManiSkill3 task (:data:`MANISKILL_TASKS`): one env, CPU physics.

    * ``images``: the RGB output of ``cameras`` (default the task's ``base_camera``), uint8
      ``(image_size, image_size, 3)``.
    * ``proprio``: ManiSkill's own flattening of the non-image observation in ``rgb`` mode
      (what its RGB baselines feed the policy): ``agent`` (``qpos``, ``qvel``) followed by the
      task's ``extra`` entries in ManiSkill's order -- always ``tcp_pose`` (position +
      wxyz quaternion), plus ``goal_pos`` (PickCube, PullCube, PickCubeSO100; the pick goals
      are not drawn in the camera image) and ``is_grasped`` (PickCube, PickCubeSO100).
      ``proprio_keys`` names the parts; the layout is fixed per task and control mode.
    * actions are clipped to the controller's action space; ``info["is_success"]`` is the
      task's ``success`` flag. There is no scripted expert (``expert_action`` is ``None``).

    Args:
        env_id: a key of :data:`MANISKILL_TASKS`.
        image_size: side of the square camera images.
        max_episode_steps: time limit; ``None`` keeps ManiSkill's (50; 100 for PushT).
        control_mode: ManiSkill controller; ``None`` picks the task's default.
        cameras: sensor names to return, in order (StackCube also has ``hand_camera``).
        render_backend: ``"cpu"`` renders with SAPIEN's CPU device (software Vulkan);
            ``"gpu"`` needs CUDA.
    """

    def __init__(
        self,
        env_id: str,
        *,
        image_size: int = 64,
        max_episode_steps: int | None = None,
        control_mode: str | None = None,
        cameras: Sequence[str] = ("base_camera",),
        render_backend: str = "cpu",
    ) -> None:
        if image_size < 8:
            raise ValueError(f"image_size must be at least 8, got {image_size}")
        if max_episode_steps is not None and max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be >= 1, got {max_episode_steps}")
        _import_maniskill()
        if not _is_maniskill_id(env_id):
            raise EnvUnavailableError(f"{env_id!r} is not a ManiSkill task")
        # Checked before building: ManiSkill would otherwise try to download the assets.
        if missing := _missing_maniskill_assets(env_id):
            from mani_skill import ASSET_DIR  # the directory ManiSkill fixed at import

            raise EnvUnavailableError(
                f"ManiSkill task {env_id} needs assets that are not in {ASSET_DIR}: "
                f"{', '.join(missing)}. Nothing is downloaded at run time; fetch them ahead with "
                f"`MS_ASSET_DIR={ASSET_DIR} python -m mani_skill.utils.download_asset {env_id}`, "
                f"or use one of the vetted tasks: {', '.join(MANISKILL_TASKS)}"
            )
        task = MANISKILL_TASKS.get(env_id)
        if task is None:
            raise EnvUnavailableError(
                f"ManiSkill task {env_id} is not vetted for JoyNexus (instruction, controller); "
                f"vetted tasks: {', '.join(MANISKILL_TASKS)}"
            )
        self.env_id = env_id
        self.instruction = task.instruction
        self.control_mode = control_mode or task.control_mode
        self.cameras = tuple(cameras)
        make_kwargs: dict[str, Any] = dict(
            obs_mode="rgb",
            num_envs=1,
            sim_backend="cpu",
            render_backend=render_backend,
            sensor_configs=dict(width=image_size, height=image_size),
            control_mode=self.control_mode,
        )
        if max_episode_steps is not None:
            make_kwargs["max_episode_steps"] = max_episode_steps
        with _maniskill_call():
            try:
                self.env: gym.Env[Any, Any] = gym.make(env_id, **make_kwargs)
            except SystemExit as exc:  # ManiSkill calls exit() when it gives up on assets
                raise EnvUnavailableError(f"ManiSkill exited while building {env_id}") from exc
        try:
            self._init_layout()
        except BaseException:
            self.env.close()
            raise

    def _init_layout(self) -> None:
        base = self.env.unwrapped
        action = base.single_action_space  # type: ignore[attr-defined]
        obs_space = base.single_observation_space  # type: ignore[attr-defined]
        if not isinstance(action, spaces.Box) or len(action.shape) != 1:
            raise EnvUnavailableError(f"{self.env_id}: expected a 1-D Box action, got {action}")
        sensors = list(obs_space["sensor_data"].keys())
        if unknown := [c for c in self.cameras if c not in sensors]:
            raise ValueError(f"{self.env_id} has no camera {unknown}; it has {sensors}")
        self.action_dim = int(action.shape[0])
        self._low_A = action.low.astype(np.float32)
        self._high_A = action.high.astype(np.float32)
        self.num_views = len(self.cameras)
        self.proprio_keys: tuple[str, ...] = tuple(
            f"{group}/{key}" for group in ("agent", "extra") for key in obs_space[group]
        )
        self.proprio_dim = sum(
            int(np.prod(obs_space[group][key].shape))
            for group, key in (k.split("/") for k in self.proprio_keys)
        )

    def reset(self, seed: int) -> StepObs:
        """Start an episode with ``seed`` (ManiSkill on CPU is deterministic per seed)."""
        with _maniskill_call():
            obs, _ = self.env.reset(seed=seed)
        return self._step_obs(obs)

    def step(self, action_A: np.ndarray) -> tuple[StepObs, float, bool, bool, dict[str, Any]]:
        """Clip ``action_A`` to the controller's range and step; see :meth:`EnvAdapter.step`.

        ``info`` holds ManiSkill's per-step entries as Python scalars (``success``,
        ``elapsed_steps``, task extras such as ``is_grasped``) plus ``is_success``.
        """
        action_1_A = _clip(action_A, self._low_A, self._high_A)[None]
        with _maniskill_call():
            obs, reward, terminated, truncated, info = self.env.step(action_1_A)
        info = {key: _scalar(value) for key, value in info.items()}
        info["is_success"] = bool(info.get("success", False))
        return (
            self._step_obs(obs),
            float(_scalar(reward)),
            bool(_scalar(terminated)),
            bool(_scalar(truncated)),
            info,
        )

    def expert_action(self) -> np.ndarray | None:
        """``None``: ManiSkill tasks come without a scripted expert here."""
        return None

    def close(self) -> None:
        """Close the env and its renderer."""
        with _maniskill_call():
            self.env.close()

    def _step_obs(self, obs: Mapping[str, Any]) -> StepObs:
        images = [
            _numpy(obs["sensor_data"][camera]["rgb"])[0].astype(np.uint8, copy=True)
            for camera in self.cameras
        ]
        parts = [
            _numpy(obs[group][key]).reshape(-1).astype(np.float32)
            for group, key in (k.split("/") for k in self.proprio_keys)
        ]
        return StepObs(images=images, instruction=self.instruction, proprio=np.concatenate(parts))


def _numpy(value: Any) -> np.ndarray:
    """A ManiSkill observation entry (a CPU torch tensor, batch first) as numpy."""
    detach = getattr(value, "detach", None)
    return detach().cpu().numpy() if detach is not None else np.asarray(value)


def _scalar(value: Any) -> Any:
    """A batch-of-one tensor / array as a Python scalar; anything else unchanged."""
    if hasattr(value, "reshape") and hasattr(value, "tolist"):
        flat = value.reshape(-1).tolist()
        if len(flat) == 1:
            return flat[0]
    return value


def _clip(action_A: np.ndarray, low_A: np.ndarray, high_A: np.ndarray) -> np.ndarray:
    action = np.asarray(action_A, dtype=np.float32)
    if action.shape != low_A.shape:
        raise ValueError(f"action must have shape {low_A.shape}, got {action.shape}")
    if not np.isfinite(action).all():
        raise ValueError(f"action must be finite, got {action}")
    return np.clip(action, low_A, high_A)


# -- choosing an adapter ------------------------------------------------------------------------


def make_adapter(
    env_id: str,
    *,
    image_size: int = 64,
    max_episode_steps: int | None = None,
    **kwargs: Any,
) -> EnvAdapter:
    """Build the adapter for ``env_id``.

    ``JoyNexus/*`` ids get a :class:`GymDictAdapter` rendering ``image_size`` images; the
    :data:`MANISKILL_TASKS` get a :class:`ManiSkillAdapter`; any other registered gymnasium id
    with a dict ``image`` / ``state`` observation gets a :class:`GymDictAdapter` (its images
    must already be ``image_size`` square). ``kwargs`` go to the adapter's constructor.

    Raises:
        EnvUnavailableError: the id is unknown, its ManiSkill assets are missing, or ManiSkill is
            not installed; the message names the id and the supported ones.
    """
    register_envs()
    if env_id.startswith("JoyNexus/"):
        if env_id not in gym.registry:
            raise EnvUnavailableError(_unknown_message(env_id))
        return GymDictAdapter(
            env_id, max_episode_steps=max_episode_steps, image_size=image_size, **kwargs
        )
    if env_id in MANISKILL_TASKS or _registered_by_maniskill(env_id):
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


def _registered_by_maniskill(env_id: str) -> bool:
    """Whether ``env_id`` is a ManiSkill task (vetted or not), so it gets ManiSkill's errors.

    Unknown ids import ManiSkill (seconds) to find out; that is the error path only.
    """
    if env_id in gym.registry and "mani_skill" not in sys.modules:
        return False  # registered before ManiSkill was imported: someone else's env
    if importlib.util.find_spec("mani_skill") is None:
        return False
    _import_maniskill()
    return _is_maniskill_id(env_id)


def _unknown_message(env_id: str) -> str:
    ours = sorted(i for i in gym.registry if i.startswith("JoyNexus/"))
    return (
        f"unknown env id {env_id!r}; supported: {', '.join(ours + list(MANISKILL_TASKS))} "
        "(or a registered gymnasium id with dict image/state observations)"
    )


__all__ = [
    "MANISKILL_TASKS",
    "EnvAdapter",
    "EnvUnavailableError",
    "GymDictAdapter",
    "ManiSkillAdapter",
    "ManiSkillTask",
    "StepObs",
    "make_adapter",
    "maniskill_asset_dir",
]
