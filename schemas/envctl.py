"""Preparing env workers' simulator sessions ahead of the tasks that need them (core NATS,
``nexus.ctl.envs.prewarm``, :data:`schemas.subjects.ENVS_PREWARM`): every env worker answers,
so a requester collects one answer per worker. Services and the operator only: a tenant's
identity may not publish there.

Building a simulator session can take seconds (ManiSkill); a worker builds one when a task
needs more sessions of its env than it holds idle. An operator (or the demo, before it
measures) asks each worker to hold ``sessions`` of an env ready, so no task pays for it."""

from __future__ import annotations

import msgspec


class PrewarmEnv(msgspec.Struct, frozen=True, tag="prewarm_env"):
    """Hold at least ``sessions`` idle sessions of ``env_id`` built the way rollout tasks
    with the same image size, episode limit and constructor arguments ask for them."""

    env_id: str
    sessions: int
    image_size: int = 64
    max_episode_steps: int = 50
    env_kwargs: dict[str, float | int | str | bool] = msgspec.field(default_factory=dict)


class EnvPrewarmed(msgspec.Struct, frozen=True, tag="env_prewarmed"):
    """One worker's answer: how many sessions of the env it holds idle now and how many it
    built for this request; ``error`` says why it could not (nothing else is set)."""

    instance: str
    env_id: str
    idle: int = 0
    built: int = 0
    error: str = ""


PREWARM_DECODER = msgspec.msgpack.Decoder(PrewarmEnv)
PREWARMED_DECODER = msgspec.msgpack.Decoder(EnvPrewarmed)
