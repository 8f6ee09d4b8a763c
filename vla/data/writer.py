"""Writing a dataset: episodes streamed in, data files rolled, metadata last, renamed into place."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vla.data.layout import (
    ACTION_KEY,
    CHUNKS_SIZE,
    CODEBASE_VERSION,
    DATA_PATH,
    EPISODES_PATH,
    FRAME_COLUMNS,
    IMAGE_PREFIX,
    INFO_PATH,
    STATE_KEY,
    STATS_PATH,
    TASKS_PATH,
    DatasetError,
    DatasetInfo,
    FeatureSpec,
    VectorStats,
)
from vla.data.png import encode_png


@dataclass(frozen=True)
class EpisodeRecord:
    """One episode to write: ``T`` frames, each an observation and the action taken there."""

    task: str
    state_T_S: np.ndarray
    action_T_A: np.ndarray
    #: Camera name (``"front"``) -> uint8 ``(T, H, W, 3)`` frames.
    images: Mapping[str, np.ndarray]
    #: Whether the episode reached its goal; ``None`` when unknown.
    success: bool | None = None


def _vectors(values_T_D: np.ndarray) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(
        pa.array(values_T_D.astype(np.float32).reshape(-1)), values_T_D.shape[1]
    )


def write_dataset(
    out_dir: str | os.PathLike[str],
    episodes: Iterable[EpisodeRecord],
    fps: int,
    *,
    robot_type: str = "unknown",
    env_id: str | None = None,
    source: str | None = None,
    frames_per_file: int = 100_000,
    overwrite: bool = False,
) -> DatasetInfo:
    """Write ``episodes`` (streamed: one in memory at a time) as a dataset at ``out_dir``.

    The dataset is built in a sibling temp directory and renamed into place, so a crash never
    leaves a half-written dataset behind. A data file is closed at the first episode boundary
    after ``frames_per_file`` frames. Raises :class:`DatasetError` for inconsistent episodes
    and ``FileExistsError`` if ``out_dir`` exists and ``overwrite`` is False.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        info = _write(tmp, episodes, fps, robot_type, env_id, source, frames_per_file)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _write(
    root: Path,
    episodes: Iterable[EpisodeRecord],
    fps: int,
    robot_type: str,
    env_id: str | None,
    source: str | None,
    frames_per_file: int,
) -> DatasetInfo:
    tasks: dict[str, int] = {}
    rows: list[dict[str, Any]] = []
    first: EpisodeRecord | None = None
    cams: list[str] = []
    schema: pa.Schema | None = None
    writer: pq.ParquetWriter | None = None
    file_number, file_frames, total = 0, 0, 0
    state_stats, action_stats = _RunningStats(), _RunningStats()
    try:
        for episode_index, ep in enumerate(episodes):
            length = len(ep.action_T_A)
            if first is None:
                first, cams = ep, sorted(ep.images)
            _check_episode(episode_index, ep, first, cams)
            if schema is None:
                schema = pa.schema(
                    [
                        ("episode_index", pa.int64()),
                        ("frame_index", pa.int64()),
                        ("timestamp", pa.float32()),
                        ("index", pa.int64()),
                        ("task_index", pa.int64()),
                        (STATE_KEY, pa.list_(pa.float32(), ep.state_T_S.shape[1])),
                        (ACTION_KEY, pa.list_(pa.float32(), ep.action_T_A.shape[1])),
                        *[(IMAGE_PREFIX + cam, pa.binary()) for cam in cams],
                    ]
                )
            task_index = tasks.setdefault(ep.task, len(tasks))
            if writer is not None and file_frames >= frames_per_file:
                writer.close()
                writer, file_number, file_frames = None, file_number + 1, 0
            chunk_index, file_index = divmod(file_number, CHUNKS_SIZE)
            if writer is None:
                path = root / DATA_PATH.format(chunk_index=chunk_index, file_index=file_index)
                path.parent.mkdir(parents=True, exist_ok=True)
                writer = pq.ParquetWriter(path, schema)
            frame_T = np.arange(length, dtype=np.int64)
            columns: list[pa.Array] = [
                pa.array(np.full(length, episode_index, np.int64)),
                pa.array(frame_T),
                pa.array((frame_T / fps).astype(np.float32)),
                pa.array(total + frame_T),
                pa.array(np.full(length, task_index, np.int64)),
                _vectors(ep.state_T_S),
                _vectors(ep.action_T_A),
                *[pa.array(map(encode_png, ep.images[cam]), pa.binary()) for cam in cams],
            ]
            writer.write_table(pa.Table.from_arrays(columns, schema=schema))
            state_stats.add(ep.state_T_S)
            action_stats.add(ep.action_T_A)
            rows.append(
                {
                    "episode_index": episode_index,
                    "length": length,
                    "task": ep.task,
                    "task_index": task_index,
                    "success": ep.success,
                    "dataset_from_index": total,
                    "dataset_to_index": total + length,
                    "data/chunk_index": chunk_index,
                    "data/file_index": file_index,
                }
            )
            total += length
            file_frames += length
    finally:
        if writer is not None:
            writer.close()
    if first is None:
        raise DatasetError("no episodes to write")

    episodes_schema = pa.schema(
        [
            ("episode_index", pa.int64()),
            ("length", pa.int64()),
            ("task", pa.string()),
            ("task_index", pa.int64()),
            ("success", pa.bool_()),
            ("dataset_from_index", pa.int64()),
            ("dataset_to_index", pa.int64()),
            ("data/chunk_index", pa.int64()),
            ("data/file_index", pa.int64()),
        ]
    )
    (root / "meta").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=episodes_schema), root / EPISODES_PATH)
    pq.write_table(
        pa.table({"task_index": pa.array(list(tasks.values()), pa.int64()), "task": list(tasks)}),
        root / TASKS_PATH,
    )
    features = {
        STATE_KEY: FeatureSpec("float32", (first.state_T_S.shape[1],)),
        ACTION_KEY: FeatureSpec("float32", (first.action_T_A.shape[1],)),
        **{
            IMAGE_PREFIX + cam: FeatureSpec(
                "image", tuple(first.images[cam].shape[1:]), ["height", "width", "channels"]
            )
            for cam in cams
        },
        "timestamp": FeatureSpec("float32", (1,)),
        **{name: FeatureSpec("int64", (1,)) for name in FRAME_COLUMNS if name != "timestamp"},
    }
    info = DatasetInfo(
        codebase_version=CODEBASE_VERSION,
        fps=fps,
        features=features,
        total_episodes=len(rows),
        total_frames=total,
        total_tasks=len(tasks),
        camera_keys=[IMAGE_PREFIX + cam for cam in cams],
        robot_type=robot_type,
        env_id=env_id,
        source=source,
    )
    (root / INFO_PATH).write_bytes(msgspec.json.format(msgspec.json.encode(info), indent=2))
    stats = {STATE_KEY: state_stats.result(), ACTION_KEY: action_stats.result()}
    (root / STATS_PATH).write_bytes(msgspec.json.format(msgspec.json.encode(stats), indent=2))
    return info


class _RunningStats:
    """Per-dimension sums of a vector feature, accumulated episode by episode (float64)."""

    def __init__(self) -> None:
        self.count = 0
        self.sum_D = np.zeros(0)
        self.sum_sq_D = np.zeros(0)
        self.min_D = np.zeros(0)
        self.max_D = np.zeros(0)

    def add(self, values_T_D: np.ndarray) -> None:
        values = values_T_D.astype(np.float64)
        if self.count == 0:
            self.sum_D, self.sum_sq_D = values.sum(0), (values**2).sum(0)
            self.min_D, self.max_D = values.min(0), values.max(0)
        else:
            self.sum_D = self.sum_D + values.sum(0)
            self.sum_sq_D = self.sum_sq_D + (values**2).sum(0)
            self.min_D = np.minimum(self.min_D, values.min(0))
            self.max_D = np.maximum(self.max_D, values.max(0))
        self.count += len(values)

    def result(self) -> VectorStats:
        mean_D = self.sum_D / self.count
        var_D = np.maximum(self.sum_sq_D / self.count - mean_D**2, 0.0)
        return VectorStats(
            mean=mean_D.tolist(),
            std=np.sqrt(var_D).tolist(),
            min=self.min_D.tolist(),
            max=self.max_D.tolist(),
            count=self.count,
        )


def _check_episode(
    episode_index: int, ep: EpisodeRecord, first: EpisodeRecord, cams: list[str]
) -> None:
    where = f"episode {episode_index}"
    if not ep.task:
        raise DatasetError(f"{where}: empty task")
    for name, values, reference in (
        (STATE_KEY, ep.state_T_S, first.state_T_S),
        (ACTION_KEY, ep.action_T_A, first.action_T_A),
    ):
        if values.ndim != 2 or values.shape[1:] != reference.shape[1:]:
            raise DatasetError(
                f"{where}: {name} has shape {values.shape}; expected (T, D) with the same D "
                f"as episode 0, {reference.shape}"
            )
        if not np.isfinite(values).all():
            frame = int(np.flatnonzero(~np.isfinite(values).all(axis=1))[0])
            raise DatasetError(f"{where}: non-finite {name} at frame {frame}")
    length = len(ep.action_T_A)
    if length == 0 or len(ep.state_T_S) != length:
        raise DatasetError(
            f"{where}: needs T >= 1 frames with one state per action, "
            f"got {len(ep.state_T_S)} states and {length} actions"
        )
    if sorted(ep.images) != cams:
        raise DatasetError(f"{where}: cameras {sorted(ep.images)}, expected {cams}")
    for cam in cams:
        frames = ep.images[cam]
        # One size for every camera: a sample's views are one (V, H, W, 3) array.
        expected = (length, *first.images[cams[0]].shape[1:])
        if frames.dtype != np.uint8 or frames.shape != expected or frames.shape[-1] != 3:
            raise DatasetError(
                f"{where}: camera {cam!r} frames are {frames.dtype} {frames.shape}, "
                f"expected uint8 {expected} with 3 channels (every camera the size of "
                f"{cams[0]!r})"
            )
