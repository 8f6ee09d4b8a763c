"""Compiling validated job specs into the messages that run them.

* SFT: an :class:`~schemas.train.OpenSlot` on the tenant's Training Queue subject and a
  :class:`~schemas.env.StreamDataset` task. The spec names a dataset by its id in the
  tenant's namespace (:mod:`bus.datasets`): a registered directory or a pushed dataset,
  materialised into the master's cache. It is checked here, at submit, from its metadata,
  its files' schemas and a few decoded frames (:func:`vla.data.check_dataset`); the env
  worker resolves the same id and validates every frame before it streams one.
* RL: an OpenSlot with the PPO settings; rollout tasks are issued per iteration as the
  trainer publishes policy versions (:func:`rollout_tasks`).
* Eval: one read-only :class:`~schemas.env.EvalTask` against a pinned policy version.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nats.js import JetStreamContext

from bus.datacache import DatasetCache
from bus.datasets import DatasetStoreError, resolve
from bus.errors import PoisonError, RetryableError
from schemas.env import EnvTask, EvalTask, RolloutTask, StreamDataset
from schemas.limits import InputLimits, exceeds
from schemas.model import HeadConfig
from schemas.specs import EvalJobSpec, HeadSpec, RLJobSpec, SessionSpec, SFTJobSpec
from schemas.train import OpenSlot, PolicyRecord
from vla.data import ACTION_KEY, STATE_KEY, DatasetError, DatasetMeta, check_dataset, read_meta
from vla.data.limits import dataset_violation

#: Batches beyond one commit interval a stream may have waiting in TRAIN.
PREFETCH_ALLOWANCE = 4


@dataclass(frozen=True)
class Plan:
    """What the master publishes to start a job."""

    backbone: str
    open_slot: OpenSlot | None
    env_tasks: list[EnvTask] = field(default_factory=list)


#: Bytes of an SFT batch besides its samples' arrays and instructions: its other fields and
#: the msgpack framing (a bound).
BATCH_OVERHEAD = 1 << 10
#: Framing bytes per sample of its instruction string.
SAMPLE_FRAMING = 8


def check_batch_bytes(ds: DatasetMeta, spec: SFTJobSpec, max_bytes: int) -> None:
    """Refuse an SFT spec whose batches would be over the trainer's ``max_message_bytes``
    (the env worker would refuse each one; a batch over the server's ``max_payload`` but
    within it travels by reference, :mod:`bus.payloads`), naming ``batch_size``."""
    views = ds.camera_keys[: spec.num_views]
    pixels = sum(math.prod(ds.info.features[key].shape) for key in views)
    head = spec.head
    floats = (head.proprio_dim or 0) + head.chunk_len * ((head.action_dim or 0) + 1)
    longest = max((len(task.encode()) for task in ds.tasks.values()), default=0)
    size = spec.batch_size * (pixels + 4 * floats + longest + SAMPLE_FRAMING) + BATCH_OVERHEAD
    if size > max_bytes:
        shape = "+".join("x".join(map(str, ds.info.features[k].shape)) for k in views)
        raise PoisonError(
            exceeds(
                f"batch_size: {spec.batch_size} samples of {shape} pixels",
                f"up to {size} bytes a batch",
                "max_message_bytes",
                max_bytes,
            )
            + ": use a smaller batch_size"
        )


def check_dataset_fits(
    ds: DatasetMeta, head: HeadSpec | HeadConfig, dataset: str, where: str = "head."
) -> None:
    """Raise PoisonError naming the mismatch between a dataset and a head (``where``
    prefixes the head's fields in the message)."""
    action_dim = ds.action_dim
    state_dim = ds.state_dim
    if head.action_dim != action_dim:
        raise PoisonError(
            f"{where}action_dim: {head.action_dim} does not match the dataset's action "
            f"dimension {action_dim} ({dataset})"
        )
    if head.proprio_dim not in (0, state_dim):  # never a silent truncation
        raise PoisonError(
            f"{where}proprio_dim: {head.proprio_dim} does not match the dataset's "
            f"observation.state dimension {state_dim} (use {state_dim}, or 0 for none)"
        )
    if not ds.camera_keys:
        raise PoisonError(f"dataset {dataset} has no camera images")


async def check_dataset_dir(
    path: Path, dataset_id: str, check: Callable[[Path], DatasetMeta] = check_dataset
) -> DatasetMeta:
    """The dataset at ``path`` checked from its metadata and a sample (not every frame), or
    by ``check`` (``read_meta``: its metadata alone)."""
    try:
        return await asyncio.to_thread(check, path)
    except DatasetError as exc:
        raise PoisonError(f"dataset {dataset_id!r}: {exc}") from exc
    except OSError as exc:
        raise PoisonError(f"dataset {dataset_id!r}: cannot read it: {exc}") from exc


@dataclass(frozen=True)
class Datasets:
    """Resolves a spec's dataset id in its tenant's namespace (``datasets`` KV) to a local
    directory: a registered path, or a pushed dataset materialised into ``cache``. A
    path, an unknown id or another tenant's id is refused, naming the namespace."""

    js: JetStreamContext
    cache: DatasetCache = field(default_factory=DatasetCache)

    async def path(self, tenant: str, dataset_id: str) -> Path:
        try:
            directory, _ = await resolve(self.js, tenant, dataset_id, self.cache)
        except DatasetStoreError as exc:
            error = RetryableError if exc.retryable else PoisonError
            raise error(f"dataset: {exc}") from exc
        return directory

    async def open(
        self, tenant: str, dataset_id: str, limits: InputLimits | None = None
    ) -> DatasetMeta:
        """The tenant's dataset ``dataset_id``: within ``limits`` by its metadata, before any
        frame is read, then checked from its metadata and a sample."""
        path = await self.path(tenant, dataset_id)
        meta = await check_dataset_dir(path, dataset_id, read_meta)
        await check_dataset_limits(dataset_id, meta, limits)
        return await check_dataset_dir(path, dataset_id)


async def check_dataset_limits(name: str, meta: DatasetMeta, limits: InputLimits | None) -> None:
    """Refuse a dataset past the operator's limits (bytes, frames, image side, episode
    length), naming the limit, before anything reads its frames."""
    violation = await asyncio.to_thread(dataset_violation, name, meta, limits or InputLimits())
    if violation:
        raise PoisonError(violation)


def _action_stats(
    ds: DatasetMeta, init: PolicyRecord | None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The dataset's action range for a new policy (as :func:`_proprio_stats`: none for a
    fine-tuned policy, which keeps its own, or a dataset without statistics)."""
    stats = ds.stats.get(ACTION_KEY)
    if init is not None or stats is None:
        return (), ()
    return tuple(stats.min), tuple(stats.max)


def _proprio_stats(
    ds: DatasetMeta, spec: SFTJobSpec, init: PolicyRecord | None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The dataset's proprio statistics for a new policy that reads proprio. A policy
    fine-tuned from ``init`` keeps the statistics it was trained with; a dataset written
    without ``meta/stats.json`` gives none (raw proprio, as before statistics existed)."""
    stats = ds.stats.get(STATE_KEY)
    if init is not None or stats is None or not spec.head.to_config().proprio_dim:
        return (), ()
    return tuple(stats.mean), tuple(stats.std)


async def compile_sft(
    job_id: str,
    spec: SFTJobSpec,
    init: PolicyRecord | None,
    datasets: Datasets,
    limits: InputLimits | None = None,
) -> Plan:
    """Validate ``spec`` against its dataset (an id in its tenant's namespace, within the
    operator's ``limits``) and build the job's start messages."""
    ds = await datasets.open(spec.tenant, spec.dataset, limits)
    # Omitted head dims are the dataset's.
    spec = spec.model_copy(
        update={"head": spec.head.filled(ds.action_dim, ds.state_dim, "dataset")}
    )
    check_dataset_fits(ds, spec.head, spec.dataset)
    check_batch_bytes(ds, spec, (limits or InputLimits()).max_message_bytes)
    if init is not None:
        check_init_fits(spec, init)
    train_episodes, _ = ds.split(spec.val_fraction, spec.seed)
    per_epoch = ds.num_batches(spec.batch_size, train_episodes, drop_last=True)
    if per_epoch == 0:
        raise PoisonError(
            f"batch_size: {spec.batch_size} is larger than the training split "
            f"({len(train_episodes)} episodes)"
        )
    total_steps = spec.steps if spec.steps is not None else per_epoch * (spec.epochs or 1)
    max_steps = (limits or InputLimits()).max_steps
    if total_steps > max_steps:  # epochs are bounded only through the steps they make
        raise PoisonError(
            f"epochs: {spec.epochs} epochs of {per_epoch} batches = {total_steps} steps "
            f"exceeds max_steps {max_steps}"
        )
    proprio_mean, proprio_std = _proprio_stats(ds, spec, init)
    action_min, action_max = _action_stats(ds, init)
    open_slot = OpenSlot(
        tenant=spec.tenant,
        job_id=job_id,
        head=spec.head.to_config(),
        optimizer=spec.optimizer.to_config(total_steps),
        seed=spec.seed,
        total_steps=total_steps,
        num_views=spec.num_views,
        token_budget=spec.token_budget,
        checkpoint_every=spec.checkpoint_every,
        priority=spec.priority,
        init_object=init.object_name if init else "",
        init_sha256=init.sha256 if init else "",
        proprio_mean=proprio_mean,
        proprio_std=proprio_std,
        action_min=action_min,
        action_max=action_max,
    )
    env_task = StreamDataset(
        tenant=spec.tenant,
        job_id=job_id,
        backbone=spec.backbone,
        dataset=spec.dataset,
        batch_size=spec.batch_size,
        total_steps=total_steps,
        chunk_len=spec.head.chunk_len,
        num_views=spec.num_views,
        seed=spec.seed,
        proprio_dim=spec.head.to_config().proprio_dim,
        val_fraction=spec.val_fraction,
        # The trainer holds applied batches unacked until their checkpoint commits, so the
        # bound must cover a commit interval plus the trainer's prefetch.
        max_in_flight=spec.checkpoint_every + PREFETCH_ALLOWANCE,
    )
    return Plan(spec.backbone, open_slot, [env_task])


def check_init_fits(spec: SFTJobSpec | RLJobSpec | SessionSpec, init: PolicyRecord) -> None:
    """A job that starts from another job's policy must keep its head's shape."""
    if init.slot.head != spec.head.to_config():
        raise PoisonError(
            f"init_from: job {init.job_id!r} has head {init.slot.head}, this job asks for "
            f"{spec.head.to_config()}; they must be identical to share weights"
        )


def compile_rl(job_id: str, spec: RLJobSpec, init: PolicyRecord | None) -> Plan:
    """The RL job's slot; its rollout tasks follow its policy versions."""
    if init is not None:
        check_init_fits(spec, init)
    open_slot = OpenSlot(
        tenant=spec.tenant,
        job_id=job_id,
        head=spec.head.to_config(),
        optimizer=spec.optimizer.to_config(spec.iterations),
        seed=spec.seed,
        total_steps=spec.iterations,
        num_views=spec.num_views,
        token_budget=spec.token_budget,
        checkpoint_every=1,
        priority=spec.priority,
        rl=spec.rl.to_config(spec.episodes_per_iteration),
        init_object=init.object_name if init else "",
        init_sha256=init.sha256 if init else "",
    )
    return Plan(spec.backbone, open_slot, [])


def compile_session(job_id: str, spec: SessionSpec, init: PolicyRecord | None) -> Plan:
    """A low-level session's slot: its calls come from the tenant, one by one."""
    if init is not None:
        check_init_fits(spec, init)
    open_slot = OpenSlot(
        tenant=spec.tenant,
        job_id=job_id,
        head=spec.head.to_config(),
        optimizer=spec.optimizer.to_config(0),
        seed=spec.seed,
        total_steps=spec.max_calls,
        num_views=spec.num_views,
        token_budget=spec.token_budget,
        checkpoint_every=spec.checkpoint_every,
        priority=spec.priority,
        init_object=init.object_name if init else "",
        init_sha256=init.sha256 if init else "",
        session=True,
    )
    return Plan(spec.backbone, open_slot, [])


def rollout_tasks(job_id: str, spec: RLJobSpec, version: int, slot: OpenSlot) -> list[RolloutTask]:
    """Tasks to run once ``version`` is committed. Version 1 is the initial policy and
    version ``v`` follows ``v - 1`` updates, so it runs iteration ``v - 1 + lag`` (all of
    iterations 0..lag at version 1), split into tasks of ``parallel_envs`` episodes.
    ``slot`` is the job's (its head's dims filled from the env at submit, its weight its
    tenant's class times its own priority)."""
    head = slot.head
    lag = spec.rl.max_policy_lag
    iterations = range(0, lag + 1) if version == 1 else [version - 1 + lag]
    tasks = []
    for iteration in iterations:
        if iteration >= spec.iterations:
            continue
        for first in range(0, spec.episodes_per_iteration, spec.parallel_envs):
            tasks.append(
                RolloutTask(
                    tenant=spec.tenant,
                    job_id=job_id,
                    backbone=spec.backbone,
                    env_id=spec.env,
                    iteration=iteration,
                    first_episode=first,
                    episodes=min(spec.parallel_envs, spec.episodes_per_iteration - first),
                    policy_version=version,
                    seed=spec.seed,
                    max_episode_steps=spec.max_episode_steps,
                    image_size=spec.image_size,
                    num_views=spec.num_views,
                    token_budget=spec.token_budget,
                    proprio_dim=head.proprio_dim,
                    parallel_envs=spec.parallel_envs,
                    env_kwargs=dict(spec.env_kwargs),
                    same_reset=spec.rl.algorithm == "grpo",
                    priority=slot.priority,
                )
            )
    return tasks


async def compile_eval(
    job_id: str,
    spec: EvalJobSpec,
    policy: PolicyRecord,
    datasets: Datasets,
    limits: InputLimits | None = None,
) -> Plan:
    """One read-only task pinned to ``policy``'s version."""
    version = spec.policy_version or policy.version
    if version > policy.version:
        raise PoisonError(
            f"policy_version: {version} is newer than job {spec.policy_job!r}'s latest "
            f"committed version {policy.version}"
        )
    if spec.dataset is not None:
        ds = await datasets.open(spec.tenant, spec.dataset, limits)
        where = f"policy_job {spec.policy_job!r}: head."
        check_dataset_fits(ds, policy.slot.head, spec.dataset, where)
        _, held_out = ds.split(spec.val_fraction, spec.seed)
        if not held_out:
            raise PoisonError(
                f"val_fraction: {spec.val_fraction} of dataset {spec.dataset}'s "
                f"{ds.num_episodes} episodes holds out none to evaluate on"
            )
    task = EvalTask(
        tenant=spec.tenant,
        job_id=job_id,
        backbone=spec.backbone,
        policy_job=spec.policy_job,
        policy_version=version,
        episodes=spec.episodes,
        seed=spec.seed,
        env_id=spec.env or "",
        dataset=spec.dataset or "",
        max_episode_steps=spec.max_episode_steps,
        image_size=spec.image_size,
        num_views=policy.slot.num_views,
        token_budget=policy.slot.token_budget,
        proprio_dim=policy.slot.head.proprio_dim,
        val_fraction=spec.val_fraction,
        parallel_envs=spec.parallel_envs,
        chunk_len=policy.slot.head.chunk_len,
        env_kwargs=dict(spec.env_kwargs),
    )
    return Plan(spec.backbone, None, [task])
