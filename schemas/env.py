"""Tasks on ``nexus.env.<tenant>.<job>`` (stream ENV), pulled by env workers."""

from __future__ import annotations

import msgspec


class StreamDataset(msgspec.Struct, frozen=True, tag="stream_dataset"):
    """Stream a tenant's offline dataset into its Training Queue as shuffled micro-batches,
    ``total_steps`` of them (cycling epochs), each with ``Nats-Msg-Id`` =
    (tenant, job, epoch, batch) so a restarted worker publishes nothing twice."""

    tenant: str
    job_id: str
    backbone: str
    dataset: str
    batch_size: int
    total_steps: int
    chunk_len: int
    num_views: int
    seed: int
    #: Leading state dims sent as proprio (the head's ``proprio_dim``).
    proprio_dim: int = 0
    #: Episodes held out of training (by :meth:`Dataset.split` with ``seed``).
    val_fraction: float = 0.0
    #: Most batches of this tenant in TRAIN at once, unconsumed or awaiting their
    #: checkpoint's commit (backpressure).
    max_in_flight: int = 4


class RolloutTask(msgspec.Struct, frozen=True, tag="rollout_task"):
    """Run ``episodes`` (indices ``first_episode`` ...) of an RL job's ``iteration`` with the
    policy version ``policy_version``, and publish each as a RolloutBatch to the job's TRAIN
    subject with ``Nats-Msg-Id`` = (tenant, job, iteration, episode). Episode ``e`` of
    iteration ``i`` resets with seed ``seed + 100_003 * i + e`` (``+ 0`` with
    ``same_reset``)."""

    tenant: str
    job_id: str
    backbone: str
    env_id: str
    iteration: int
    first_episode: int
    episodes: int
    policy_version: int
    seed: int
    max_episode_steps: int
    image_size: int = 64
    num_views: int = 1
    token_budget: int = 16
    proprio_dim: int = 0
    #: Sessions stepped in lockstep (one batched act request per step).
    parallel_envs: int = 4
    #: Constructor arguments of the env.
    env_kwargs: dict[str, float | int | str | bool] = msgspec.field(default_factory=dict)
    #: Every episode of the iteration resets with the same seed (GRPO: the group-relative
    #: baseline compares episodes from one initial state).
    same_reset: bool = False
    #: The job's weight (its tenant's priority class times its own priority): its act
    #: requests carry it, and the inferencer shares batches by it.
    priority: int = 1


class EvalTask(msgspec.Struct, frozen=True, tag="eval_task"):
    """Evaluate a fixed policy version (read-only): ``episodes`` of ``env_id`` with
    deterministic actions, or the held-out split of ``dataset`` (action error)."""

    tenant: str
    job_id: str
    backbone: str
    policy_job: str
    policy_version: int
    episodes: int
    seed: int
    env_id: str = ""
    dataset: str = ""
    max_episode_steps: int = 50
    image_size: int = 64
    num_views: int = 1
    token_budget: int = 16
    proprio_dim: int = 0
    val_fraction: float = 0.2
    parallel_envs: int = 4
    #: The policy head's chunk length (dataset targets are chunks of this length).
    chunk_len: int = 1
    env_kwargs: dict[str, float | int | str | bool] = msgspec.field(default_factory=dict)


EnvTask = StreamDataset | RolloutTask | EvalTask
ENV_DECODER = msgspec.msgpack.Decoder(EnvTask)
