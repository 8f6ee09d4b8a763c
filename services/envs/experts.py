"""Scripted experts for ManiSkill tasks: privileged-state controllers that record
demonstrations.

Each expert reads the simulator's true poses (cube, goal, tool centre point) and answers the
action to take now in ``pd_ee_delta_pos`` (``[dx, dy, dz, gripper]``, each in ``[-1, 1]``; a
unit of motion is 0.1 m, the Panda controller's range; gripper ``-1`` closes, ``+1`` opens).
They are stateless: the action depends on the current state alone, so an expert picks up
wherever an episode stands (after a reset, a nudge or a slipped grasp).

Measured here (20 seeds each, 64x64 rendering): PushCube-v1 20/20 in 8-13 steps, PullCube-v1
20/20 in 9-13, PickCube-v1 20/20 in 15-23. The grasping expert closes the gripper when the
fingers are around the cube and lifts only once ManiSkill says the cube ``is_grasped`` (a
fixed-timer close makes demos that a policy cannot imitate). The recorder keeps successful
episodes only when asked (``record(..., only_success=True)``), so a rare miss does not teach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

#: The control mode every expert here acts in.
EXPERT_CONTROL_MODE = "pd_ee_delta_pos"
#: Metres per unit of a ``pd_ee_delta_pos`` position action on the Panda.
_METRES_PER_UNIT = 0.1
_CLOSE = -1.0
_OPEN = 1.0
#: Height above the cube's centre at which the tool travels to its next position.
_TRAVEL_HEIGHT_M = 0.06
#: Gap between the tool centre and the face of the cube it pushes.
_PUSH_STANDOFF_M = 0.02
#: How close (m) the tool must be to a waypoint before the expert moves on.
_REACHED_M = 0.01


def _xyz(position: Any) -> np.ndarray:
    """A batch-of-one ManiSkill position tensor as a float64 ``(3,)`` array."""
    return np.asarray(position.reshape(-1)[:3].cpu().numpy(), dtype=np.float64)


def _toward(tcp_3: np.ndarray, target_3: np.ndarray, gripper: float) -> np.ndarray:
    """The ``pd_ee_delta_pos`` action moving the tool from ``tcp_3`` to ``target_3`` (as far as
    one step allows)."""
    delta_3 = np.clip((target_3 - tcp_3) / _METRES_PER_UNIT, -1.0, 1.0)
    return np.array([*delta_3, gripper], dtype=np.float32)


def _push_along_x(env: Any, direction: float) -> np.ndarray:
    """Push the cube along ``direction`` x (+1 away from the robot, -1 toward it) onto the goal.

    Travel above the cube to the point behind it (as seen along the push), go down, then move
    the tool to where it stands when the cube's centre is on the goal's.
    """
    tcp = _xyz(env.agent.tcp.pose.p)
    cube = _xyz(env.obj.pose.p)
    goal = _xyz(env.goal_region.pose.p)
    half = float(env.cube_half_size)
    behind = np.array([cube[0] - direction * (half + _PUSH_STANDOFF_M), cube[1], half])
    in_position = (
        abs(tcp[1] - cube[1]) < _REACHED_M
        and direction * (cube[0] - tcp[0]) > half
        and tcp[2] < half + 1.5 * _REACHED_M
    )
    if in_position:
        pushed_to = np.array([goal[0] - direction * (half + 0.005), cube[1], half])
        return _toward(tcp, pushed_to, _CLOSE)
    if np.linalg.norm(tcp[:2] - behind[:2]) > _REACHED_M:
        return _toward(tcp, np.array([behind[0], behind[1], half + _TRAVEL_HEIGHT_M]), _CLOSE)
    return _toward(tcp, behind, _CLOSE)


def push_cube_expert(env: Any) -> np.ndarray:
    """PushCube-v1: the goal lies +x (away from the robot) of the cube."""
    return _push_along_x(env, +1.0)


def pull_cube_expert(env: Any) -> np.ndarray:
    """PullCube-v1: the goal lies -x (toward the robot) of the cube."""
    return _push_along_x(env, -1.0)


def pick_cube_expert(env: Any) -> np.ndarray:
    """PickCube-v1: over the cube with the gripper open, down, close until ManiSkill says the
    cube is grasped, then carry it to the goal."""
    tcp = _xyz(env.agent.tcp.pose.p)
    cube = _xyz(env.cube.pose.p)
    if bool(env.agent.is_grasping(env.cube).reshape(-1)[0]):
        return _toward(tcp, _xyz(env.goal_site.pose.p), _CLOSE)
    if np.linalg.norm(tcp[:2] - cube[:2]) > _REACHED_M:
        above = np.array([cube[0], cube[1], max(tcp[2], cube[2] + 0.04)])
        return _toward(tcp, above, _OPEN)
    if tcp[2] - cube[2] > _REACHED_M:
        return _toward(tcp, cube, _OPEN)
    return _toward(tcp, cube, _CLOSE)


def _cube_and_goal(env: Any) -> tuple[Any, Any] | None:
    """The cube and goal actors of a cube task's *unwrapped* env, or ``None``."""
    # Explicit ``is None``: a ManiSkill actor's truth value is not its presence.
    cube = getattr(env, "cube", None)
    if cube is None:
        cube = getattr(env, "obj", None)
    goal = getattr(env, "goal_site", None)
    if goal is None:
        goal = getattr(env, "goal_region", None)
    if cube is None or goal is None:
        return None
    return cube, goal


def privileged_positions(env: Any) -> dict[str, np.ndarray] | None:
    """The true cube, goal and tool-centre positions of a cube task's *unwrapped* env
    (float32 xyz each), or ``None`` for a task without one cube and one goal.

    A goal the task hides from its cameras (PickCube's goal site, in ManiSkill's
    ``_hidden_objects``) is left out: no image tells where it is, so as a pretraining target
    it could only be memorised frame by frame (measured: its held-out probe R² fell from
    -0.05 to -0.5 over a pretraining run that kept it)."""
    found = _cube_and_goal(env)
    if found is None:
        return None
    cube, goal = found
    positions = {
        "cube_xyz": _xyz(cube.pose.p).astype(np.float32),
        "tcp_xyz": _xyz(env.agent.tcp.pose.p).astype(np.float32),
    }
    if not any(hidden is goal for hidden in getattr(env, "_hidden_objects", ())):
        positions["goal_xyz"] = _xyz(goal.pose.p).astype(np.float32)
    return positions


#: Task extras a tenant may add to a cube task's proprio (``proprio_extras``), with their
#: sizes: what the robot does not sense itself but the simulator knows.
TASK_EXTRA_SIZES: dict[str, int] = {
    "cube_pose": 7,  # position xyz + orientation quaternion wxyz
    "goal_xyz": 3,
}


def task_extras(env: Any) -> dict[str, np.ndarray] | None:
    """The :data:`TASK_EXTRA_SIZES` entries of a cube task's *unwrapped* env (float32), or
    ``None`` for a task without one cube and one goal."""
    found = _cube_and_goal(env)
    if found is None:
        return None
    cube, goal = found
    quaternion = np.asarray(cube.pose.q.reshape(-1)[:4].cpu().numpy(), dtype=np.float64)
    return {
        "cube_pose": np.concatenate([_xyz(cube.pose.p), quaternion]).astype(np.float32),
        "goal_xyz": _xyz(goal.pose.p).astype(np.float32),
    }


#: ManiSkill task id -> its expert, called with the *unwrapped* env.
MANISKILL_EXPERTS: dict[str, Callable[[Any], np.ndarray]] = {
    "PushCube-v1": push_cube_expert,
    "PullCube-v1": pull_cube_expert,
    "PickCube-v1": pick_cube_expert,
}


def expert_for(env_id: str, control_mode: str) -> Callable[[Any], np.ndarray] | None:
    """The scripted expert of ``env_id`` when the env acts in the experts' control mode."""
    if control_mode != EXPERT_CONTROL_MODE:
        return None
    return MANISKILL_EXPERTS.get(env_id)
