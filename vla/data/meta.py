"""A dataset known from its metadata, and the cheap check a submit runs on it.

:func:`check_dataset` reads ``meta/``, every data file's parquet footer (schema and row
counts) and decodes a few sampled frames; it does not read the frames' columns, so its cost
does not grow with the dataset. The full validation (every value, every image) is
:func:`vla.data.load_dataset`, which the env worker runs before it streams a single batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vla.data.layout import (
    ACTION_KEY,
    EPISODES_PATH,
    INFO_PATH,
    STATE_KEY,
    TASKS_PATH,
    DatasetError,
    DatasetInfo,
    EpisodeMeta,
    VectorStats,
)
from vla.data.png import decode_png
from vla.data.reader import (
    check_image_type,
    check_vector_type,
    data_columns,
    data_paths,
    ints,
    read_info,
    read_stats,
    read_table,
    read_tasks,
)

#: Frames :func:`check_dataset` decodes per camera by default.
SAMPLE_FRAMES = 4
#: Rows read at a time while looking for the sampled frames of a row group.
_CHECK_BATCH_ROWS = 1024


@dataclass(frozen=True)
class DatasetMeta:
    """What a dataset's metadata says: enough to plan a job on it without reading frames.

    Episodes are in ``episode_index`` order and their frames are consecutive rows, so
    :meth:`split` and :meth:`num_batches` give the same answers here as on the loaded
    :class:`~vla.data.Dataset`.
    """

    root: Path
    info: DatasetInfo
    #: task_index -> task text (the instruction).
    tasks: dict[int, str]
    episodes: list[EpisodeMeta]
    #: ``meta/stats.json`` by feature (``observation.state``, ``action``); empty if absent.
    stats: dict[str, VectorStats] = field(default_factory=dict)
    _by_episode: dict[int, EpisodeMeta] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_episode", {ep.episode_index: ep for ep in self.episodes})

    @property
    def num_episodes(self) -> int:
        return len(self.episodes)

    @property
    def num_frames(self) -> int:
        return sum(ep.length for ep in self.episodes)

    @property
    def camera_keys(self) -> tuple[str, ...]:
        return tuple(self.info.camera_keys)

    @property
    def action_dim(self) -> int:
        return int(self.info.features[ACTION_KEY].shape[0])

    @property
    def state_dim(self) -> int:
        return int(self.info.features[STATE_KEY].shape[0])

    def split(self, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
        """``(train, val)`` episode indices, a seeded random split by episode.

        With ``val_fraction > 0`` and at least two episodes, val gets at least one episode
        and train keeps at least one.
        """
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        ids = np.array([ep.episode_index for ep in self.episodes], np.int64)
        n_val = round(val_fraction * len(ids))
        if val_fraction > 0 and len(ids) >= 2:
            n_val = min(max(n_val, 1), len(ids) - 1)
        shuffled = np.random.default_rng(seed).permutation(ids)
        return sorted(shuffled[n_val:].tolist()), sorted(shuffled[:n_val].tolist())

    def rows(self, episodes: Iterable[int] | None = None) -> np.ndarray:
        """Frame rows of ``episodes`` (default: all) in row order, whatever their order."""
        if episodes is None:
            return np.arange(self.num_frames, dtype=np.int64)
        parts = []
        for episode in sorted(set(episodes)):  # the caller's order must not change batches
            meta = self._by_episode.get(episode)
            if meta is None:
                raise ValueError(f"episode {episode} is not in the dataset")
            parts.append(np.arange(meta.from_index, meta.to_index, dtype=np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def num_batches(
        self, batch_size: int, episodes: Iterable[int] | None = None, *, drop_last: bool = False
    ) -> int:
        """Micro-batches of ``batch_size`` frames per epoch over ``episodes`` (default: all)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        frames = len(self.rows(episodes))
        return frames // batch_size if drop_last else -(-frames // batch_size)


def read_episodes(table: pa.Table, tasks: dict[int, str]) -> list[EpisodeMeta]:
    """``meta/episodes.parquet`` in episode order, rows numbered by consecutive lengths."""
    ids = ints(table, "episode_index", EPISODES_PATH)
    lengths = ints(table, "length", EPISODES_PATH)
    texts = table.column("task").to_pylist()
    success = table.column("success").to_pylist() if "success" in table.column_names else None
    if len(set(ids.tolist())) != len(ids):
        raise DatasetError(f"{EPISODES_PATH}: duplicate episode_index")
    known = set(tasks.values())
    episodes, start = [], 0
    for i in np.argsort(ids, kind="stable").tolist():
        episode, length = int(ids[i]), int(lengths[i])
        if length < 1:
            raise DatasetError(f"episode {episode}: {EPISODES_PATH} says length {length}")
        if texts[i] not in known:
            raise DatasetError(f"episode {episode}: task {texts[i]!r} not in {TASKS_PATH}")
        ok = None if success is None else success[i]
        episodes.append(EpisodeMeta(episode, length, str(texts[i]), ok, start, start + length))
        start += length
    return episodes


def read_meta(root: str | Path) -> DatasetMeta:
    """``meta/`` read and checked for consistency; no data file is opened."""
    path = Path(root)
    info = read_info(path)
    tasks = read_tasks(path)
    table = read_table(path / EPISODES_PATH, path, ["episode_index", "length", "task"])
    meta = DatasetMeta(path, info, tasks, read_episodes(table, tasks), read_stats(path, info))
    if (info.total_episodes, info.total_frames) != (meta.num_episodes, meta.num_frames):
        raise DatasetError(
            f"{INFO_PATH}: total_episodes={info.total_episodes}, total_frames="
            f"{info.total_frames}, but {EPISODES_PATH} has {meta.num_episodes} episodes and "
            f"{meta.num_frames} frames"
        )
    return meta


def check_dataset(root: str | Path, *, sample_frames: int = SAMPLE_FRAMES) -> DatasetMeta:
    """What a submit checks: metadata, the data files' schemas and row counts, and a sample.

    Reads ``meta/`` (:func:`read_meta`), each data file's footer (columns, types, vector
    sizes against ``info.json``, rows adding up to ``total_frames``), and decodes
    ``sample_frames`` frames spread evenly over the data, the first and the last included,
    every camera (reading only the row groups that hold them). Values and the other images
    are not read: a bad frame elsewhere is found by :func:`vla.data.load_dataset` in the env
    worker. Raises :class:`~vla.data.layout.DatasetError`.
    """
    meta = read_meta(root)
    info, path = meta.info, meta.root
    #: (file, row group, first row of the group) for every row group, in frame order.
    row_groups: list[tuple[pq.ParquetFile, int, int]] = []
    rows, first_schema, first_rel = 0, None, ""
    for file in data_paths(path):
        rel = file.relative_to(path).as_posix()
        try:
            parquet = pq.ParquetFile(file)
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(f"{rel}: unreadable parquet file: {exc}") from exc
        schema = parquet.schema_arrow
        missing = [name for name in data_columns(info) if name not in schema.names]
        if missing:
            raise DatasetError(f"{rel}: missing column {', '.join(repr(m) for m in missing)}")
        if first_schema is None:
            first_schema, first_rel = schema, rel
            _check_types(meta, schema)
        elif not schema.equals(first_schema, check_metadata=False):
            raise DatasetError(f"{rel}: schema differs from {first_rel}")
        for group in range(parquet.num_row_groups):
            row_groups.append((parquet, group, rows))
            rows += parquet.metadata.row_group(group).num_rows
    if rows != info.total_frames:
        raise DatasetError(
            f"{INFO_PATH}: total_frames={info.total_frames}, but the data files have {rows} rows"
        )
    if rows == 0:  # as load_dataset says it: no job could train or evaluate on it
        raise DatasetError(f"{path}: the data files have no frames")
    samples = np.unique(np.linspace(0, rows - 1, min(sample_frames, rows)).round().astype(int))
    starts = np.array([start for _, _, start in row_groups])
    groups = np.searchsorted(starts, samples, side="right") - 1
    for g in np.unique(groups).tolist():
        parquet, group, start = row_groups[g]
        _check_frames(meta, parquet, group, (samples[groups == g] - start).tolist())
    return meta


def _check_types(meta: DatasetMeta, schema: pa.Schema) -> None:
    for name in ("episode_index", "frame_index", "index", "task_index"):
        if not pa.types.is_integer(schema.field(name).type):
            raise DatasetError(f"column {name!r}: expected integers, got {schema.field(name).type}")
    for name in (STATE_KEY, ACTION_KEY):
        check_vector_type(name, schema.field(name).type, meta.info.features[name])
    for key in meta.camera_keys:
        check_image_type(key, schema.field(key).type)


def _check_frames(
    meta: DatasetMeta, parquet: pq.ParquetFile, group: int, offsets: list[int]
) -> None:
    """Decode the frames at ``offsets`` of one row group, every camera."""
    columns = ["episode_index", "frame_index", *meta.camera_keys]
    # Read in batches, keeping only the sampled rows: a whole row group (millions of rows of
    # one dictionary-encoded image, a few hundred KB on disk) took gigabytes of memory.
    wanted = sorted(set(offsets))
    kept: list[pa.Table] = []
    start = 0
    for batch in parquet.iter_batches(
        batch_size=_CHECK_BATCH_ROWS, row_groups=[group], columns=columns
    ):
        end = start + batch.num_rows
        inside = [o - start for o in wanted if start <= o < end]
        if inside:
            kept.append(pa.Table.from_batches([batch]).take(inside))
        start = end
        if start > wanted[-1]:
            break
    table = pa.concat_tables(kept) if kept else None
    if table is None or table.num_rows != len(wanted):
        raise DatasetError(f"row group {group} has fewer rows than its metadata says")
    for i in range(table.num_rows):
        where = f"episode {table['episode_index'][i]}, frame {table['frame_index'][i]}"
        for key in meta.camera_keys:
            data = table[key][i].as_py()
            if data is None:
                raise DatasetError(f"column {key!r}: missing image at {where}")
            decode_png(data, tuple(meta.info.features[key].shape), key, where)
