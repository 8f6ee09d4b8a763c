"""SFT micro-batches from a loaded dataset: shuffled frames with their action chunks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from vla.data import Dataset


@dataclass(frozen=True)
class Batch:
    """A micro-batch of ``B`` frames for SFT, with ``C``-step action chunks.

    ``actions_B_C_A[b, c]`` is the action ``c`` frames after frame ``b`` in its episode; past
    the episode's end it repeats the episode's last action and ``action_pad_B_C`` is True.
    """

    epoch: int
    batch_index: int
    #: Global frame index (the ``index`` column) of each sample.
    index_B: np.ndarray
    episode_index_B: np.ndarray
    frame_index_B: np.ndarray
    camera_keys: tuple[str, ...]
    images_B_V_H_W_3: np.ndarray
    state_B_S: np.ndarray
    instructions: list[str]
    actions_B_C_A: np.ndarray
    action_pad_B_C: np.ndarray


def iter_batches(
    ds: Dataset,
    batch_size: int,
    chunk_len: int = 1,
    seed: int = 0,
    epoch: int = 0,
    episodes: Iterable[int] | None = None,
    *,
    drop_last: bool = False,
    start_batch: int = 0,
) -> Iterator[Batch]:
    """Shuffled micro-batches over the frames of ``episodes`` (default: all) of ``ds``.

    The order is a permutation drawn from ``(seed, epoch)``: the same pair gives the same
    batches, another epoch another order, and one epoch visits every frame exactly once
    (the last batch is smaller unless ``drop_last``); there are ``ds.num_batches(batch_size,
    episodes, drop_last=drop_last)`` of them. ``start_batch`` resumes an epoch.
    """
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
    count = ds.num_batches(batch_size, episodes, drop_last=drop_last)
    rows_R = ds.meta.rows(episodes)
    order_R = rows_R[np.random.default_rng([seed, epoch]).permutation(len(rows_R))]
    # Exclusive end row of each frame's episode: where action chunks stop.
    episode_end_N = np.repeat(
        np.array([ep.to_index for ep in ds.episodes], np.int64),
        np.array([ep.length for ep in ds.episodes], np.int64),
    )
    offsets_C = np.arange(chunk_len, dtype=np.int64)
    for batch_index in range(start_batch, count):
        rows_B = order_R[batch_index * batch_size : (batch_index + 1) * batch_size]
        end_B = episode_end_N[rows_B]
        ahead_B_C = rows_B[:, None] + offsets_C
        pad_B_C = ahead_B_C >= end_B[:, None]
        ahead_B_C = np.minimum(ahead_B_C, end_B[:, None] - 1)
        yield Batch(
            epoch=epoch,
            batch_index=batch_index,
            index_B=rows_B,  # rows are validated to equal the `index` column
            episode_index_B=ds.episode_index_N[rows_B],
            frame_index_B=ds.frame_index_N[rows_B],
            camera_keys=ds.camera_keys,
            images_B_V_H_W_3=ds.images(rows_B),
            state_B_S=ds.state_N_S[rows_B],
            instructions=[ds.tasks[t] for t in ds.task_index_N[rows_B].tolist()],
            actions_B_C_A=ds.action_N_A[ahead_B_C],
            action_pad_B_C=pad_B_C,
        )
