"""Reach2D: a tiny, fast image environment with a language instruction and a scripted expert.

The arena is the square ``[-1, 1]^2`` (x right, y up) rendered top-down as an RGB ``uint8``
image. A white agent dot must reach the coloured target dot that the instruction names
(``"reach the red dot"``); ``num_distractors`` other dots in other colours make the policy
ground the colour word in the image instead of going to "the" dot.

* observation: ``{"image": uint8 (H, W, 3), "state": float32 (4,), "instruction": str}``;
  ``state = (x, y, vx, vy)`` with the position in arena units and the velocity of the last
  step in units of ``max_speed`` (so every entry lies in ``[-1, 1]``).
* action: float32 ``(2,)`` in ``[-1, 1]``, a velocity command; the agent moves by
  ``action * max_speed`` per step and stops at the walls.
* reward: potential-based progress ``progress_scale * (d_prev - d)`` (dense, and it does not
  change which policy is optimal) plus ``success_bonus`` on the step that reaches the target.
* terminated when the agent is within ``success_radius`` of the target; truncated after 50
  steps by the ``TimeLimit`` that ``gym.make("JoyNexus/Reach2D-v0")`` adds (override with
  ``max_episode_steps=``). ``info["is_success"]`` says whether the target was reached.

Everything random comes from ``self.np_random``, so ``reset(seed=s)`` fixes the episode.
Rendering is plain numpy on a cached background (the dots do not move) and touches only the
agent's bounding box per step; a step costs tens of microseconds.
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

#: Target / distractor colours. Exact RGB values, so a colour mask finds a dot exactly.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 240),
    "yellow": (230, 210, 40),
}
AGENT_RGB = (255, 255, 255)
BACKGROUND_RGB = (24, 24, 24)
INSTRUCTION_TEMPLATE = "reach the {colour} dot"
#: Default speed limit: arena units per step at |action| = 1 (the arena is 2 units wide).
DEFAULT_MAX_SPEED = 0.1
_INSTRUCTION_CHARSET = frozenset(string.ascii_lowercase + " ")
#: Dots are placed this far from the walls, so they are never clipped by the image border.
_DOT_MARGIN = 0.8
#: The farthest start asked of a reset: from a target anywhere on the arena such starts
#: remain (from one at the centre, about 7% of the arena).
MAX_START_DISTANCE = 1.0
#: Rejection-sampling tries before a reset gives up (the bounds above make that unlikely).
_MAX_TRIES = 10_000


class Reach2DEnv(gym.Env[dict[str, Any], np.ndarray]):
    """Move the agent dot onto the dot whose colour the instruction names.

    Args:
        image_size: ``H`` (square) or ``(H, W)`` of the rendered observation.
        num_distractors: dots in other colours besides the target (0 to ``len(COLOURS) - 1``).
        max_speed: arena units moved per step at full action.
        success_radius: agent-target distance that counts as reached.
        dot_radius: drawn radius of every dot, in arena units.
        success_bonus: reward added on the step that reaches the target.
        progress_scale: weight of the distance-progress reward.
        min_start_distance: minimum agent-target distance at reset.
        gripper: add a third action dimension, a gripper command (> 0 closes); success then
            also requires the gripper closed within ``success_radius`` ("reach and grasp").
        target_in_state: append the target's position to ``state`` (6-D): the easiest
            variant, where the policy need not read the target off the image (for fast RL
            checks of the training machinery).
        render_mode: ``None`` or ``"rgb_array"`` (``render()`` returns the current image).
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(
        self,
        *,
        image_size: int | tuple[int, int] = 64,
        num_distractors: int = 1,
        max_speed: float = DEFAULT_MAX_SPEED,
        success_radius: float = 0.1,
        dot_radius: float = 0.08,
        success_bonus: float = 1.0,
        progress_scale: float = 1.0,
        min_start_distance: float = 0.4,
        gripper: bool = False,
        target_in_state: bool = False,
        render_mode: str | None = None,
    ) -> None:
        self.target_in_state = bool(target_in_state)
        height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
        if height < 8 or width < 8:
            raise ValueError(f"image_size must be at least 8x8, got {(height, width)}")
        if not 0 <= num_distractors < len(COLOURS):
            raise ValueError(
                f"num_distractors must be in [0, {len(COLOURS) - 1}], got {num_distractors}"
            )
        for name, value in (
            ("max_speed", max_speed),
            ("success_radius", success_radius),
            ("dot_radius", dot_radius),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not 0 <= min_start_distance <= MAX_START_DISTANCE:
            raise ValueError(
                f"min_start_distance must be in [0, {MAX_START_DISTANCE}] (a start that far "
                f"from any target fits the arena), got {min_start_distance}"
            )
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        self.height, self.width = int(height), int(width)
        self.num_distractors = num_distractors
        self.max_speed = float(max_speed)
        self.success_radius = float(success_radius)
        self.success_bonus = float(success_bonus)
        self.progress_scale = float(progress_scale)
        self.min_start_distance = float(min_start_distance)
        self.render_mode = render_mode
        # Never draw a dot smaller than a pixel: at tiny image sizes it could miss every
        # pixel centre and vanish.
        self.dot_radius = max(float(dot_radius), 0.75 * 2.0 / min(self.height, self.width))

        self.observation_space = spaces.Dict(
            {
                "image": spaces.Box(0, 255, (self.height, self.width, 3), np.uint8),
                "state": spaces.Box(-1.0, 1.0, (6 if target_in_state else 4,), np.float32),
                "instruction": spaces.Text(max_length=64, charset=_INSTRUCTION_CHARSET),
            }
        )
        self.gripper = bool(gripper)
        self.action_space = spaces.Box(-1.0, 1.0, (3 if self.gripper else 2,), np.float32)

        # Arena coordinates of pixel centres: column j -> x, row i -> y (row 0 is the top).
        self._pixel_x_W = (np.arange(self.width) + 0.5) * (2.0 / self.width) - 1.0
        self._pixel_y_H = 1.0 - (np.arange(self.height) + 0.5) * (2.0 / self.height)
        self._background_H_W_3 = np.zeros((self.height, self.width, 3), np.uint8)
        self._dots_mask_H_W = np.zeros((self.height, self.width), bool)
        self._image_H_W_3 = self._background_H_W_3
        self._agent = (0.0, 0.0)
        self._velocity = (0.0, 0.0)
        self._target = (0.0, 0.0)
        self._target_colour = next(iter(COLOURS))
        self._instruction = ""
        self._has_reset = False

    # -- gymnasium API -------------------------------------------------------------------

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        rng = self.np_random
        names = list(COLOURS)
        order = rng.permutation(len(names))[: 1 + self.num_distractors]
        dots = self._sample_dots(len(order))
        self._target = dots[0]
        self._target_colour = names[int(order[0])]
        self._instruction = INSTRUCTION_TEMPLATE.format(colour=self._target_colour)

        self._background_H_W_3[:] = BACKGROUND_RGB
        self._dots_mask_H_W[:] = False
        for (x, y), colour_id in zip(dots, order, strict=True):
            rows, cols, mask = self._disk(x, y)
            self._background_H_W_3[rows, cols][mask] = COLOURS[names[int(colour_id)]]
            self._dots_mask_H_W[rows, cols] |= mask

        for _ in range(_MAX_TRIES):  # rejection sampling; the accepted region is most of it
            ax, ay = (float(v) for v in rng.uniform(-0.9, 0.9, size=2))
            if math.dist((ax, ay), self._target) >= self.min_start_distance:
                break
        else:
            raise RuntimeError(
                f"no start at min_start_distance {self.min_start_distance} from the target at "
                f"{self._target} in {_MAX_TRIES} tries"
            )
        self._agent = (ax, ay)
        self._velocity = (0.0, 0.0)
        self._has_reset = True
        self._render_frame()
        return self._observation(), {"is_success": False, "distance": self._distance()}

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        if not self._has_reset:
            raise RuntimeError("call reset() before step()")
        flat = np.asarray(action, dtype=np.float64).reshape(self.action_space.shape)
        if not np.isfinite(flat).all():
            raise ValueError(f"action must be finite, got {tuple(flat)}")
        ax, ay = float(flat[0]), float(flat[1])
        ax, ay = min(max(ax, -1.0), 1.0), min(max(ay, -1.0), 1.0)
        before = self._distance()
        old_x, old_y = self._agent
        x = min(max(old_x + ax * self.max_speed, -1.0), 1.0)
        y = min(max(old_y + ay * self.max_speed, -1.0), 1.0)
        self._agent = (x, y)
        # The velocity actually realised (zero into a wall), in action units.
        self._velocity = ((x - old_x) / self.max_speed, (y - old_y) / self.max_speed)
        after = self._distance()
        success = after <= self.success_radius and (not self.gripper or float(flat[2]) > 0.0)
        reward = self.progress_scale * (before - after) + (self.success_bonus if success else 0.0)
        self._render_frame()
        return (
            self._observation(),
            reward,
            success,
            False,
            {"is_success": success, "distance": after},
        )

    def render(self) -> np.ndarray | None:
        return self._image_H_W_3.copy() if self.render_mode == "rgb_array" else None

    # -- expert and introspection ----------------------------------------------------------

    def expert_action(self) -> np.ndarray:
        """The scripted expert's action from the true state: straight at the target (and, with
        a gripper, close it once within twice the success radius)."""
        move = _straight_to(self._agent, self._target, self.max_speed)
        if not self.gripper:
            return move
        close = 1.0 if self._distance() <= 2 * self.success_radius else -1.0
        return np.array([move[0], move[1], close], np.float32)

    def privileged_state(self) -> dict[str, np.ndarray]:
        """True positions a policy does not observe directly (pretraining targets)."""
        return {
            "target_xy": np.asarray(self._target, np.float32),
            "agent_xy": np.asarray(self._agent, np.float32),
        }

    #: The instruction names a colour per episode (for env descriptions).
    instruction_template = INSTRUCTION_TEMPLATE

    @property
    def control_mode(self) -> str:
        """What an action means: a velocity command (plus a gripper command)."""
        return "velocity+gripper" if self.gripper else "velocity"

    @property
    def state_layout(self) -> tuple[str, ...]:
        """Names of the ``state`` entries, in order."""
        layout = ("x", "y", "vx", "vy")
        return (*layout, "target_x", "target_y") if self.target_in_state else layout

    @property
    def target_colour(self) -> str:
        return self._target_colour

    @property
    def target_position(self) -> tuple[float, float]:
        return self._target

    @property
    def agent_position(self) -> tuple[float, float]:
        return self._agent

    # -- internals --------------------------------------------------------------------------

    def _sample_dots(self, count: int) -> list[tuple[float, float]]:
        # Dots keep clear of each other so the target is never covered by a distractor.
        min_gap = 3.0 * self.dot_radius
        dots: list[tuple[float, float]] = []
        for _ in range(_MAX_TRIES):
            x, y = (float(v) for v in self.np_random.uniform(-_DOT_MARGIN, _DOT_MARGIN, size=2))
            if all(math.dist((x, y), d) >= min_gap for d in dots):
                dots.append((x, y))
                if len(dots) == count:
                    return dots
        raise RuntimeError(
            f"{count} dots of dot_radius {self.dot_radius} do not fit the arena apart "
            f"(placed {len(dots)} in {_MAX_TRIES} tries)"
        )

    def _disk(self, cx: float, cy: float) -> tuple[slice, slice, np.ndarray]:
        """Pixels whose centre lies within ``dot_radius`` of ``(cx, cy)``, in a bounding box."""
        r = self.dot_radius
        sx, sy = self.width / 2.0, self.height / 2.0
        c0 = max(math.ceil((cx - r + 1.0) * sx - 0.5), 0)
        c1 = min(math.floor((cx + r + 1.0) * sx - 0.5) + 1, self.width)
        r0 = max(math.ceil((1.0 - cy - r) * sy - 0.5), 0)
        r1 = min(math.floor((1.0 - cy + r) * sy - 0.5) + 1, self.height)
        dx_W = self._pixel_x_W[c0:c1] - cx
        dy_H = self._pixel_y_H[r0:r1] - cy
        mask_H_W = dy_H[:, None] ** 2 + dx_W[None, :] ** 2 <= r * r
        return slice(r0, r1), slice(c0, c1), mask_H_W

    def _render_frame(self) -> None:
        image = self._background_H_W_3.copy()
        rows, cols, mask = self._disk(*self._agent)
        # Dots are drawn over the agent, so the target stays fully visible when reached.
        image[rows, cols][mask & ~self._dots_mask_H_W[rows, cols]] = AGENT_RGB
        self._image_H_W_3 = image

    def _observation(self) -> dict[str, Any]:
        parts = (*self._agent, *self._velocity, *(self._target if self.target_in_state else ()))
        state = np.array(parts, dtype=np.float32)
        return {"image": self._image_H_W_3, "state": state, "instruction": self._instruction}

    def _distance(self) -> float:
        return math.dist(self._agent, self._target)


def _straight_to(
    agent: tuple[float, float], target: tuple[float, float], max_speed: float
) -> np.ndarray:
    dx, dy = (target[0] - agent[0]) / max_speed, (target[1] - agent[1]) / max_speed
    # Scale both axes together so the direction is kept when the command saturates.
    scale = max(1.0, abs(dx), abs(dy))
    return np.array((dx / scale, dy / scale), dtype=np.float32)


def target_from_image(image_H_W_3: np.ndarray, instruction: str) -> tuple[float, float]:
    """Arena position of the dot whose colour ``instruction`` names, found in the image."""
    colour = next((word for word in instruction.split() if word in COLOURS), None)
    if colour is None:
        raise ValueError(f"instruction {instruction!r} names none of the colours {list(COLOURS)}")
    mask_H_W = np.all(image_H_W_3 == np.asarray(COLOURS[colour], np.uint8), axis=-1)
    rows, cols = np.nonzero(mask_H_W)
    if rows.size == 0:
        raise ValueError(f"no {colour} dot in the image")
    height, width = mask_H_W.shape
    return (
        float((cols.mean() + 0.5) * 2.0 / width - 1.0),
        float(1.0 - (rows.mean() + 0.5) * 2.0 / height),
    )


def scripted_expert(
    source: gym.Env[Any, Any] | Mapping[str, Any], *, max_speed: float = DEFAULT_MAX_SPEED
) -> np.ndarray:
    """The expert's float32 ``(2,)`` action, from a (wrapped) Reach2D env or from an observation.

    From an env it uses the true target position. From an observation it finds the target as
    the centroid of the instructed colour's pixels and reads the agent position from
    ``state`` -- what a policy sees -- so pass the env's ``max_speed`` if it is not default.
    """
    if isinstance(source, gym.Env):
        env = source.unwrapped
        if not isinstance(env, Reach2DEnv):
            raise TypeError(f"scripted_expert needs a Reach2D env, got {type(env).__name__}")
        return env.expert_action()
    state = np.asarray(source["state"], dtype=np.float64)
    target = target_from_image(np.asarray(source["image"]), str(source["instruction"]))
    return _straight_to((float(state[0]), float(state[1])), target, max_speed)
