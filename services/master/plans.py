"""Compiling a validated job spec into the messages that run it.

An SFT job becomes: an :class:`~schemas.train.OpenSlot` on the tenant's Training Queue
subject and a :class:`~schemas.env.StreamDataset` task for the env workers. The dataset is
loaded and validated here, at submit, so a bad dataset is rejected with a specific error
before any slot exists.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from bus.errors import PoisonError
from schemas.env import StreamDataset
from schemas.specs import SFTJobSpec
from schemas.train import OpenSlot
from services.envs.datasets import Dataset, DatasetError, load_dataset

#: Batches beyond one commit interval a stream may have waiting in TRAIN.
PREFETCH_ALLOWANCE = 4


@dataclass(frozen=True)
class Plan:
    """What the master publishes to start a job."""

    backbone: str
    open_slot: OpenSlot
    env_task: StreamDataset


def check_dataset_fits(ds: Dataset, spec: SFTJobSpec) -> None:
    """Raise PoisonError naming the mismatch between a dataset and the job's head."""
    action_dim = ds.action_N_A.shape[1]
    state_dim = ds.state_N_S.shape[1]
    if spec.head.action_dim != action_dim:
        raise PoisonError(
            f"head.action_dim: {spec.head.action_dim} does not match the dataset's action "
            f"dimension {action_dim} ({spec.dataset})"
        )
    if spec.head.proprio_dim > state_dim:
        raise PoisonError(
            f"head.proprio_dim: {spec.head.proprio_dim} exceeds the dataset's "
            f"observation.state dimension {state_dim}"
        )
    if not ds.camera_keys:
        raise PoisonError(f"dataset {spec.dataset} has no camera images")


async def compile_plan(job_id: str, spec: SFTJobSpec) -> Plan:
    """Validate ``spec`` against its dataset and build the job's start messages."""
    try:
        ds = await asyncio.to_thread(load_dataset, spec.dataset)
    except DatasetError as exc:
        raise PoisonError(f"dataset: {exc}") from exc
    except OSError as exc:
        raise PoisonError(f"dataset: cannot read {spec.dataset}: {exc}") from exc
    check_dataset_fits(ds, spec)
    train_episodes, _ = ds.split(spec.val_fraction, spec.seed)
    per_epoch = ds.num_batches(spec.batch_size, train_episodes, drop_last=True)
    if per_epoch == 0:
        raise PoisonError(
            f"batch_size: {spec.batch_size} is larger than the training split "
            f"({len(train_episodes)} episodes)"
        )
    total_steps = spec.steps if spec.steps is not None else per_epoch * (spec.epochs or 1)
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
        proprio_dim=spec.head.proprio_dim,
        val_fraction=spec.val_fraction,
        # The trainer holds applied batches unacked until their checkpoint commits, so the
        # bound must cover a commit interval plus the trainer's prefetch.
        max_in_flight=spec.checkpoint_every + PREFETCH_ALLOWANCE,
    )
    return Plan(spec.backbone, open_slot, env_task)
