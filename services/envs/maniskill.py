"""ManiSkill3 behind the :class:`~services.envs.adapters.EnvAdapter` interface: the vetted
tasks, importing ManiSkill, and :class:`ManiSkillAdapter` (CPU physics, software-Vulkan
rendering; ``scripts/setup-maniskill.sh`` installs both).

Creating a ManiSkill env costs seconds (importing ManiSkill ~5-10 s, the first env in a process
compiles shaders), while ``reset`` costs tens of milliseconds: keep one adapter per task and
start every episode with ``reset(seed=...)``. SAPIEN drops its renderer, with the compiled
shaders, when the last env using it closes, and the next env pays the ~12 s again (measured with
software Vulkan); so the first adapter of a process keeps one render system of its own on the
same device for the life of the process (:func:`_keep_renderer`), and later envs build in
~0.3 s even after all others closed.

Nothing here reads stdin, downloads, or touches the process environment:

* ManiSkill fixes its asset directory from ``MS_ASSET_DIR`` when it is first imported, so the
  process's starter chooses it: ``joynexus up`` gives every role ``$JOYNEXUS_HOME/maniskill``
  unless the operator set ``MS_ASSET_DIR`` (``services.launcher``); elsewhere ManiSkill's own
  default (``~/.maniskill``) applies. Messages name the directory ManiSkill actually uses.
* A task whose assets are missing is refused before its env is built
  (:class:`~services.envs.adapters.EnvUnavailableError`, from ManiSkill's own asset check), so
  ManiSkill's download prompt is never reached. Should it be reached anyway, stdin is
  ``/dev/null`` during every ManiSkill call: the prompt reads EOF and the build fails with
  ``EnvUnavailableError`` -- it neither waits nor downloads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from services.envs.adapters import EnvUnavailableError, StepObs, clip_action
from services.envs.experts import (
    TASK_EXTRA_SIZES,
    expert_for,
    privileged_positions,
    task_extras,
)


@dataclass(frozen=True)
class ManiSkillTask:
    """How we run one vetted ManiSkill task."""

    #: The instruction given to the policy (ManiSkill tasks have none of their own).
    instruction: str
    #: Default controller: end-effector position deltas where the robot has them.
    control_mode: str
    #: Rebuild the scene at every reset. In grasping tasks a plain ``reset(seed)`` leaves
    #: physics state behind (measured: 5 of 8 PickCube episodes whose gripper closed on the
    #: cube came out differently after other episodes ran in the same env), so an episode
    #: would depend on what its env ran before; rebuilt, it depends on its seed alone, at
    #: ~0.21 s more per reset (0.26 s against 0.04 s).
    rebuild_on_reset: bool = False


#: ManiSkill3 tasks the adapter is vetted on (all use robots bundled with the mani-skill wheel,
#: so none needs a download). Measured action / proprio dims with the default control mode:
#: PushCube 4/25, PickCube 4/29, PullCube 4/28, StackCube 4/25, PickCubeSO100 6/23, PushT 3/21.
MANISKILL_TASKS: dict[str, ManiSkillTask] = {
    "PushCube-v1": ManiSkillTask("push the cube to the goal region", "pd_ee_delta_pos"),
    "PickCube-v1": ManiSkillTask(
        "pick up the cube and move it to the goal", "pd_ee_delta_pos", rebuild_on_reset=True
    ),
    "PullCube-v1": ManiSkillTask("pull the cube to the goal region", "pd_ee_delta_pos"),
    "StackCube-v1": ManiSkillTask(
        "stack the red cube on the green cube", "pd_ee_delta_pos", rebuild_on_reset=True
    ),
    # The SO100 arm has joint controllers only.
    "PickCubeSO100-v1": ManiSkillTask(
        "pick up the cube and move it to the goal", "pd_joint_delta_pos", rebuild_on_reset=True
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


#: One call into ManiSkill at a time in a process. Two envs stepped at the same moment from
#: two threads change each other's episodes (measured: 7 of 12 PickCube episodes differed
#: from the same episodes stepped one call at a time; calls of two envs taking turns change
#: nothing), and the warning filters and stdin swapped below are process-wide. An env worker
#: steps its tasks' simulators in threads, so the lock costs it nothing the GIL did not
#: (two threads stepping two envs took as long as one stepping both).
_call_lock = threading.RLock()


@contextlib.contextmanager
def maniskill_call() -> Iterator[None]:
    """Around calls into ManiSkill: one at a time in the process, its known deprecation
    warnings silenced, stdin at EOF."""
    with _call_lock, _stdin_closed(), warnings.catch_warnings():
        for message in _MANISKILL_DEPRECATIONS:
            warnings.filterwarnings("ignore", message, DeprecationWarning)
        yield


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


#: Serialises the first import: ``mani_skill.envs`` is in ``sys.modules`` from the moment its
#: import starts, so a second thread (two describes building at once) would otherwise see a
#: half-imported module and a task registry that is not filled yet.
_import_lock = threading.Lock()
_imported = False


#: One SAPIEN render system per render device, held for the life of the process (see the
#: module docstring): while it lives, SAPIEN keeps the device's renderer and compiled shaders.
_kept_renderers: dict[str, Any] = {}


def _keep_renderer(env: gym.Env[Any, Any]) -> None:
    """Hold a render system on ``env``'s render device, once per device; a no-op for an env
    that does not render. (``_render_device`` is mani-skill 3.0.1's, the version pinned.)"""
    device = getattr(env.unwrapped, "_render_device", None)
    if device is None:
        return
    key = str(device)
    if key in _kept_renderers:
        return
    import sapien  # ManiSkill's simulator; importable once ManiSkill is

    with maniskill_call():
        _kept_renderers[key] = sapien.render.RenderSystem(device)


def import_maniskill() -> None:
    """Import ManiSkill, registering its tasks with gymnasium (seconds, once per process)."""
    global _imported
    if _imported:
        return
    with _import_lock:
        if _imported:
            return
        if importlib.util.find_spec("mani_skill") is None:
            raise EnvUnavailableError(
                "ManiSkill is not installed: run `bash scripts/setup-maniskill.sh .venv` "
                "(the Makefile's install step does)"
            )
        with maniskill_call():
            import mani_skill.envs  # noqa: F401  (registers the tasks)
        _imported = True


def asset_dir() -> str:
    """The asset directory ManiSkill fixed at import (``$MS_ASSET_DIR/data`` or its default)."""
    from mani_skill import ASSET_DIR

    return str(ASSET_DIR)


def _is_maniskill_id(env_id: str) -> bool:
    from mani_skill.utils.registration import REGISTERED_ENVS

    return env_id in REGISTERED_ENVS


def _missing_assets(env_id: str) -> list[str]:
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


def is_maniskill_task(env_id: str) -> bool:
    """Whether ``env_id`` is a ManiSkill task (vetted or not), so it gets ManiSkill's errors.

    Unknown ids import ManiSkill (seconds) to find out; that is the error path only.
    """
    if env_id in MANISKILL_TASKS:
        return True
    if env_id in gym.registry and "mani_skill" not in sys.modules:
        return False  # registered before ManiSkill was imported: someone else's env
    if importlib.util.find_spec("mani_skill") is None:
        return False
    import_maniskill()
    return _is_maniskill_id(env_id)


class ManiSkillAdapter:
    """Adapter for a vetted ManiSkill3 task (:data:`MANISKILL_TASKS`): one env, CPU physics.

    * ``images``: the RGB output of ``cameras`` (default the task's ``base_camera``), uint8
      ``(image_size, image_size, 3)``.
    * ``proprio``: ManiSkill's own flattening of the non-image observation in ``rgb`` mode
      (what its RGB baselines feed the policy): ``agent`` (``qpos``, ``qvel``) followed by the
      task's ``extra`` entries in ManiSkill's order -- always ``tcp_pose`` (position +
      wxyz quaternion), plus ``goal_pos`` (PickCube, PullCube, PickCubeSO100; the pick goals
      are not drawn in the camera image) and ``is_grasped`` (PickCube, PickCubeSO100).
      Then the ``task/<name>`` extras asked for with ``proprio_extras`` (the cube's pose, the
      goal's position: what the robot does not sense). ``proprio_keys`` names the parts; the
      layout is fixed per task, control mode and extras.
    * actions are clipped to the controller's action space; ``info["is_success"]`` is the
      task's ``success`` flag. ``expert_action`` is the task's scripted expert
      (:mod:`services.envs.experts`) where it has one.

    Args:
        env_id: a key of :data:`MANISKILL_TASKS`.
        image_size: side of the square camera images.
        max_episode_steps: time limit; ``None`` keeps ManiSkill's (50; 100 for PushT).
        control_mode: ManiSkill controller; ``None`` picks the task's default.
        cameras: sensor names to return, in order (StackCube also has ``hand_camera``).
        render_backend: ``"cpu"`` renders with SAPIEN's CPU device (software Vulkan);
            ``"gpu"`` needs CUDA.
        proprio_extras: task extras appended to the proprio as ``task/<name>`` parts, names
            of :data:`~services.envs.experts.TASK_EXTRA_SIZES` (a list, or one string of
            comma-separated names as env kwargs carry it); none by default, so the proprio is
            what the robot senses itself.
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
        proprio_extras: str | Sequence[str] = (),
    ) -> None:
        if image_size < 8:
            raise ValueError(f"image_size must be at least 8, got {image_size}")
        if max_episode_steps is not None and max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be >= 1, got {max_episode_steps}")
        import_maniskill()
        if not _is_maniskill_id(env_id):
            raise EnvUnavailableError(f"{env_id!r} is not a ManiSkill task")
        # Checked before building: ManiSkill would otherwise prompt to download the assets.
        if missing := _missing_assets(env_id):
            where = asset_dir()
            raise EnvUnavailableError(
                f"ManiSkill task {env_id} needs assets that are not in {where}: "
                f"{', '.join(missing)}. Nothing is downloaded at run time; fetch them ahead with "
                f"`MS_ASSET_DIR={os.path.dirname(where)} python -m "
                f"mani_skill.utils.download_asset {env_id}`, "
                f"or use one of the vetted tasks: {', '.join(MANISKILL_TASKS)}"
            )
        task = MANISKILL_TASKS.get(env_id)
        if task is None:
            raise EnvUnavailableError(
                f"ManiSkill task {env_id} is not vetted for JoyNexus (instruction, controller); "
                f"vetted tasks: {', '.join(MANISKILL_TASKS)}"
            )
        self.env_id = env_id
        self.rebuild_on_reset = task.rebuild_on_reset
        self.instruction = task.instruction
        self.control_mode = control_mode or task.control_mode
        self.cameras = tuple(cameras)
        self.image_size = image_size
        self.proprio_extras = _extra_names(proprio_extras)
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
        with maniskill_call():
            try:
                self.env: gym.Env[Any, Any] = gym.make(env_id, **make_kwargs)
            except EOFError as exc:  # its download prompt read our closed stdin
                raise EnvUnavailableError(
                    f"ManiSkill asked to download assets for {env_id} (into {asset_dir()}); "
                    "nothing is downloaded at run time"
                ) from exc
            except SystemExit as exc:  # ManiSkill calls exit() when it gives up on assets
                raise EnvUnavailableError(f"ManiSkill exited while building {env_id}") from exc
        try:
            _keep_renderer(self.env)
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
        #: Task extras this task can add to the proprio (``proprio_extras``), with sizes.
        self.available_extras: dict[str, int] = (
            dict(TASK_EXTRA_SIZES) if task_extras(base) is not None else {}
        )
        if unknown := [n for n in self.proprio_extras if n not in self.available_extras]:
            offered = ", ".join(self.available_extras) or "none"
            raise ValueError(
                f"proprio_extras: {self.env_id} has no task extra {', '.join(unknown)}; "
                f"it offers: {offered}"
            )
        own = [f"{group}/{key}" for group in ("agent", "extra") for key in obs_space[group]]
        self.proprio_keys: tuple[str, ...] = (
            *own,
            *(f"task/{name}" for name in self.proprio_extras),
        )
        #: Size of each ``proprio_keys`` part, in order.
        self.proprio_sizes: tuple[int, ...] = (
            *(int(np.prod(obs_space[g][k].shape)) for g, k in (key.split("/") for key in own)),
            *(TASK_EXTRA_SIZES[name] for name in self.proprio_extras),
        )
        self.proprio_dim = sum(self.proprio_sizes)

    def reset(self, seed: int) -> StepObs:
        """Start an episode with ``seed``: the same seed and actions give the same episode
        whatever the env ran before (grasping tasks rebuild their scene for it:
        :attr:`ManiSkillTask.rebuild_on_reset`)."""
        options = {"reconfigure": True} if self.rebuild_on_reset else None
        with maniskill_call():
            # ManiSkill seeds numpy's RandomState, which takes 32 bits; an episode's seed
            # (a job's seed plus iteration and episode offsets) can pass that.
            obs, _ = self.env.reset(seed=seed % 2**32, options=options)
        return self._step_obs(obs)

    def step(self, action_A: np.ndarray) -> tuple[StepObs, float, bool, bool, dict[str, Any]]:
        """Clip ``action_A`` to the controller's range and step; see :meth:`EnvAdapter.step`.

        ``info`` holds ManiSkill's per-step entries as Python scalars (``success``,
        ``elapsed_steps``, task extras such as ``is_grasped``) plus ``is_success``.
        """
        action_1_A = clip_action(action_A, self._low_A, self._high_A)[None]
        with maniskill_call():
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
        """The task's scripted expert's action now (:mod:`services.envs.experts`: PushCube,
        PullCube, PickCube in ``pd_ee_delta_pos``); ``None`` for other tasks and modes."""
        expert = expert_for(self.env_id, self.control_mode)
        if expert is None:
            return None
        with maniskill_call():
            return expert(self.env.unwrapped)

    def privileged_state(self) -> dict[str, np.ndarray] | None:
        """True object, goal and tool positions (:func:`services.envs.experts.privileged_positions`)
        where the task has one cube and one goal; ``None`` otherwise."""
        with maniskill_call():
            return privileged_positions(self.env.unwrapped)

    def close(self) -> None:
        """Close the env and its renderer."""
        with maniskill_call():
            self.env.close()

    def _step_obs(self, obs: Mapping[str, Any]) -> StepObs:
        images = [
            _numpy(obs["sensor_data"][camera]["rgb"])[0].astype(np.uint8, copy=True)
            for camera in self.cameras
        ]
        extras: dict[str, np.ndarray] = {}
        if self.proprio_extras:
            with maniskill_call():
                extras = task_extras(self.env.unwrapped) or {}
        parts = [
            extras[key] if group == "task" else _numpy(obs[group][key]).reshape(-1)
            for group, key in (k.split("/") for k in self.proprio_keys)
        ]
        parts = [part.astype(np.float32) for part in parts]
        return StepObs(images=images, instruction=self.instruction, proprio=np.concatenate(parts))


def _extra_names(extras: str | Sequence[str]) -> tuple[str, ...]:
    """``"cube_pose, goal_xyz"`` or ``["cube_pose", "goal_xyz"]`` as names, in order."""
    names = extras.split(",") if isinstance(extras, str) else list(extras)
    cleaned = tuple(n.strip() for n in names if n.strip())
    if len(set(cleaned)) != len(cleaned):
        raise ValueError(f"proprio_extras: a name is given twice in {list(cleaned)}")
    return cleaned


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


__all__ = ["MANISKILL_TASKS", "ManiSkillAdapter", "ManiSkillTask", "is_maniskill_task"]
