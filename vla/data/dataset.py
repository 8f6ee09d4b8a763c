"""The full validation: a dataset read into memory, every value and every image checked.

:func:`load_dataset` validates everything it relies on and raises
:class:`~vla.data.layout.DatasetError` naming the file, column, episode or frame at fault; it
decodes every image once and, within a memory budget, keeps them decoded, so sampling
batches is array indexing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa

from vla.data.layout import (
    ACTION_KEY,
    EPISODES_PATH,
    INFO_PATH,
    STATE_KEY,
    TASKS_PATH,
    DatasetError,
    DatasetInfo,
    EpisodeMeta,
)
from vla.data.meta import DatasetMeta
from vla.data.png import decode_png
from vla.data.reader import (
    check_image_type,
    first,
    ints,
    read_data,
    read_info,
    read_table,
    read_tasks,
    vector_column,
)


class Dataset:
    """A validated dataset held in memory: per-frame columns and the frames' images.

    Rows are frames in ``index`` order; per-frame arrays are named with an ``_N`` suffix.
    Build one with :func:`load_dataset`; sample SFT batches from it with
    ``services.envs.datasets.iter_batches``.
    """

    def __init__(
        self, meta: DatasetMeta, table: pa.Table, *, verify_images: bool, image_cache_mb: float
    ) -> None:
        self.meta = meta
        info = meta.info
        self.episode_index_N = ints(table, "episode_index")
        self.frame_index_N = ints(table, "frame_index")
        self.task_index_N = ints(table, "task_index")
        self.state_N_S = vector_column(table, STATE_KEY, info.features[STATE_KEY])
        self.action_N_A = vector_column(table, ACTION_KEY, info.features[ACTION_KEY])
        self._check_values()
        self._png = {key: self._png_column(table, key) for key in info.camera_keys}
        self._images: dict[str, np.ndarray] | None = None
        decoded_bytes = sum(
            len(self) * math.prod(info.features[key].shape) for key in info.camera_keys
        )
        if decoded_bytes <= image_cache_mb * 2**20:
            self._images = {key: self._decode(key, np.arange(len(self))) for key in self._png}
        elif verify_images:
            for key in self._png:  # check them all, in slices, without keeping them
                for start in range(0, len(self), 1024):
                    self._decode(key, np.arange(start, min(start + 1024, len(self))))

    def __len__(self) -> int:
        return len(self.frame_index_N)

    @property
    def root(self) -> Path:
        return self.meta.root

    @property
    def info(self) -> DatasetInfo:
        return self.meta.info

    @property
    def tasks(self) -> dict[int, str]:
        """task_index -> task text (the instruction)."""
        return self.meta.tasks

    @property
    def episodes(self) -> list[EpisodeMeta]:
        return self.meta.episodes

    @property
    def num_episodes(self) -> int:
        return self.meta.num_episodes

    @property
    def camera_keys(self) -> tuple[str, ...]:
        return self.meta.camera_keys

    def split(self, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
        """See :meth:`DatasetMeta.split`."""
        return self.meta.split(val_fraction, seed)

    def num_batches(
        self, batch_size: int, episodes: Iterable[int] | None = None, *, drop_last: bool = False
    ) -> int:
        """See :meth:`DatasetMeta.num_batches`."""
        return self.meta.num_batches(batch_size, episodes, drop_last=drop_last)

    def where(self, row: int) -> str:
        """``"episode E, frame F"`` of ``row``, as error messages name a frame."""
        return f"episode {self.episode_index_N[row]}, frame {self.frame_index_N[row]}"

    def _check_values(self) -> None:
        for name, values in ((ACTION_KEY, self.action_N_A), (STATE_KEY, self.state_N_S)):
            bad_N = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
            if bad_N.any():
                row = first(bad_N)
                raise DatasetError(
                    f"column {name!r}: non-finite value {values[row].tolist()} at {self.where(row)}"
                )
        known = np.array(sorted(self.tasks), np.int64)
        unknown_N = ~np.isin(self.task_index_N, known)
        if unknown_N.any():
            row = first(unknown_N)
            raise DatasetError(
                f"task_index {self.task_index_N[row]} at {self.where(row)} is not in "
                f"{TASKS_PATH} (known: {known.tolist()})"
            )

    def _png_column(self, table: pa.Table, key: str) -> list[bytes]:
        column = table.column(key)
        check_image_type(key, column.type)
        if column.null_count:
            row = first(np.asarray(column.is_null().to_numpy(zero_copy_only=False)))
            raise DatasetError(f"column {key!r}: missing image at {self.where(row)}")
        return column.to_pylist()

    def _decode(self, key: str, rows_B: np.ndarray) -> np.ndarray:
        expected = tuple(self.info.features[key].shape)
        out_B_H_W_3 = np.empty((len(rows_B), *expected), np.uint8)
        for i, row in enumerate(rows_B.tolist()):
            out_B_H_W_3[i] = decode_png(self._png[key][row], expected, key, self.where(row))
        return out_B_H_W_3

    def images(self, rows_B: np.ndarray) -> np.ndarray:
        """uint8 ``(B, V, H, W, 3)`` frames of ``rows_B`` for all cameras, in view order."""
        shapes = {tuple(self.info.features[key].shape) for key in self.camera_keys}
        if len(shapes) > 1:
            raise DatasetError(f"cameras have different image shapes {sorted(shapes)}")
        views = [
            self._images[key][rows_B] if self._images is not None else self._decode(key, rows_B)
            for key in self.camera_keys
        ]
        return np.stack(views, axis=1)


def _episode_metas(
    table: pa.Table, info: DatasetInfo, episode_index_N: np.ndarray, frame_index_N: np.ndarray
) -> list[EpisodeMeta]:
    """Check that frames form contiguous, ordered episodes matching ``meta/episodes.parquet``."""
    n = len(frame_index_N)
    # Row where each run of equal episode_index starts (n >= 1 is checked by the caller).
    starts_E = np.flatnonzero(np.r_[True, episode_index_N[1:] != episode_index_N[:-1]])
    ids_E = episode_index_N[starts_E]
    if (np.diff(ids_E) <= 0).any():
        e = first(np.diff(ids_E) <= 0)
        raise DatasetError(
            f"column 'episode_index': episode {ids_E[e + 1]} follows episode {ids_E[e]}; "
            "episodes must be contiguous and in increasing order"
        )
    lengths_E = np.diff(np.r_[starts_E, n])
    expected_N = np.arange(n) - np.repeat(starts_E, lengths_E)
    if (frame_index_N != expected_N).any():
        row = first(frame_index_N != expected_N)
        raise DatasetError(
            f"column 'frame_index': episode {episode_index_N[row]} has frame_index "
            f"{frame_index_N[row]} at position {expected_N[row]}; expected 0..length-1 in order"
        )
    meta_ids = ints(table, "episode_index", EPISODES_PATH)
    meta_lengths = ints(table, "length", EPISODES_PATH)
    tasks = table.column("task").to_pylist()
    success = table.column("success").to_pylist() if "success" in table.column_names else None
    rows = {int(e): i for i, e in enumerate(meta_ids)}
    if len(rows) != len(meta_ids):
        raise DatasetError(f"{EPISODES_PATH}: duplicate episode_index")
    missing = sorted(set(ids_E.tolist()) - set(rows))
    if missing:
        raise DatasetError(f"episode {missing[0]} is in the data but not in {EPISODES_PATH}")
    extra = sorted(set(rows) - set(ids_E.tolist()))
    if extra:
        raise DatasetError(f"episode {extra[0]} is in {EPISODES_PATH} but has no frames")
    metas = []
    for start, episode, length in zip(
        starts_E.tolist(), ids_E.tolist(), lengths_E.tolist(), strict=True
    ):
        i = rows[episode]
        if meta_lengths[i] != length:
            raise DatasetError(
                f"episode {episode}: {EPISODES_PATH} says length {meta_lengths[i]}, "
                f"the data has {length} frames"
            )
        metas.append(
            EpisodeMeta(
                episode,
                length,
                str(tasks[i]),
                None if success is None else success[i],
                start,
                start + length,
            )
        )
    if info.total_episodes != len(metas) or info.total_frames != n:
        raise DatasetError(
            f"{INFO_PATH}: total_episodes={info.total_episodes}, total_frames="
            f"{info.total_frames}, but the data has {len(metas)} episodes and {n} frames"
        )
    return metas


def load_dataset(
    root: str | os.PathLike[str], *, verify_images: bool = True, image_cache_mb: float = 512.0
) -> Dataset:
    """Read and validate the dataset at ``root``; raise :class:`DatasetError` naming the problem.

    Images are decoded once here and kept when they fit in ``image_cache_mb``; otherwise
    they are decoded per batch, and checked here only if ``verify_images``.
    """
    path = Path(root)
    info = read_info(path)
    tasks = read_tasks(path)
    episodes_table = read_table(path / EPISODES_PATH, path, ["episode_index", "length", "task"])
    table = read_data(path, info)
    index_N = ints(table, "index")
    if len(index_N) == 0:
        raise DatasetError(f"{path}: the data files have no frames")
    if (index_N != np.arange(len(index_N))).any():
        row = first(index_N != np.arange(len(index_N)))
        raise DatasetError(
            f"column 'index': row {row} has index {index_N[row]}; frames must be numbered "
            "0..N-1 in file order"
        )
    episodes = _episode_metas(
        episodes_table, info, ints(table, "episode_index"), ints(table, "frame_index")
    )
    known = set(tasks.values())
    for ep in episodes:
        if ep.task not in known:
            raise DatasetError(f"episode {ep.episode_index}: task {ep.task!r} not in {TASKS_PATH}")
    meta = DatasetMeta(path, info, tasks, episodes)
    return Dataset(meta, table, verify_images=verify_images, image_cache_mb=image_cache_mb)
