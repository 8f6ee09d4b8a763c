"""What an environment looks like to a policy, and the request-reply that asks an env worker.

The master checks a job's head against an :class:`EnvDescription` at submit and the SDK /
``joynexus env describe`` print one; neither builds a simulator. They send a
:class:`DescribeEnv` on :data:`schemas.subjects.ENV_DESCRIBE` (core NATS request-reply, no
stream) and an env worker answers with a :class:`DescribeReply`: a description, or an error
naming why the env cannot be built (an unknown id names the supported ones).
"""

from __future__ import annotations

import msgspec


class ActionSpace(msgspec.Struct, frozen=True):
    """The flat float action vector ``step`` takes (actions are clipped to the bounds)."""

    dim: int
    #: Per-dimension lower and upper bounds, ``dim`` each.
    low: list[float]
    high: list[float]
    #: What an action means (ManiSkill's controller, e.g. ``pd_joint_delta_pos``; our sims
    #: say ``velocity`` or ``velocity+gripper``).
    control_mode: str


class ProprioPart(msgspec.Struct, frozen=True):
    """One named run of the proprio vector, in order (e.g. ``agent/qpos`` of size 9)."""

    name: str
    size: int


class Camera(msgspec.Struct, frozen=True):
    """One camera view the env worker sends the policy, in view order."""

    name: str
    height: int
    width: int


class EnvDescription(msgspec.Struct, frozen=True):
    """An environment's layout as a policy sees it, for given constructor arguments."""

    env_id: str
    action: ActionSpace
    #: Length of the proprio vector (the head's ``proprio_dim`` must be this, or 0 for none).
    proprio_dim: int
    proprio_layout: list[ProprioPart]
    cameras: list[Camera]
    #: The env's own time limit (a job's ``max_episode_steps`` overrides it).
    max_episode_steps: int
    #: The task instruction; for envs whose instruction varies per episode, its template
    #: (Reach2D: ``reach the {colour} dot``).
    instruction: str
    env_kwargs: dict[str, float | int | str | bool] = msgspec.field(default_factory=dict)
    #: Task extras the env can append to the proprio (env kwarg ``proprio_extras``, names
    #: comma-separated); those asked for are already in ``proprio_layout`` as ``task/<name>``.
    proprio_extras: list[ProprioPart] = msgspec.field(default_factory=list)


class DescribeEnv(msgspec.Struct, frozen=True):
    """Request: describe ``env_id`` built with ``env_kwargs``, rendering ``image_size``
    square images."""

    env_id: str
    env_kwargs: dict[str, float | int | str | bool] = msgspec.field(default_factory=dict)
    image_size: int = 64


class DescribeReply(msgspec.Struct, frozen=True):
    """Reply: ``description``, or ``None`` and ``error`` saying why the env cannot be built."""

    description: EnvDescription | None = None
    error: str = ""
    #: The same request may be answered later (the worker was busy building others).
    retryable: bool = False


DESCRIBE_REQUEST_DECODER = msgspec.msgpack.Decoder(DescribeEnv)
DESCRIBE_REPLY_DECODER = msgspec.msgpack.Decoder(DescribeReply)
