"""SFT on the trainer: a micro-batch becomes a :class:`~vla.grouping.TrainRequest` for the
grouped step, after its shapes are checked against the job's head."""

from __future__ import annotations

import numpy as np
import torch

from schemas.tensor import TensorError
from schemas.train import ForwardBackward, SFTBatch
from services.trainer.jobs import JobSlot
from vla.grouping import TrainRequest


def build_request(job: JobSlot, batch: SFTBatch | ForwardBackward) -> TrainRequest:
    """The batch (an SFT step's, or a session's forward) as model inputs for ``job``'s slot,
    for a whole step; :class:`ValueError` names a field whose shape or dtype does not fit the
    job's head."""
    try:
        images = batch.images.to_numpy()
        proprio = batch.proprio.to_numpy()
        actions = batch.actions.to_numpy()
    except TensorError as exc:
        raise ValueError(str(exc)) from exc
    if images.ndim != 5 or len(batch.instructions) != images.shape[0]:
        raise ValueError(f"images {images.shape} vs {len(batch.instructions)} instructions")
    head = job.spec.head
    want = (images.shape[0], head.chunk_len, head.action_dim)
    if actions.shape != want or actions.dtype != np.float32:
        raise ValueError(f"actions: expected float32 {want}, got {actions.dtype} {actions.shape}")
    if proprio.shape != (images.shape[0], head.proprio_dim):
        raise ValueError(
            f"proprio: expected {(images.shape[0], head.proprio_dim)}, got {proprio.shape}"
        )
    inputs = job.normaliser.normalise_arrays(images, batch.instructions, proprio.astype(np.float32))
    return TrainRequest(job.key, job.slot, inputs, torch.from_numpy(actions.copy()))
