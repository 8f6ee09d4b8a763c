"""Reading a dataset's files into checked arrow tables and numpy columns.

Every reader raises :class:`~vla.data.layout.DatasetError` naming the file and column at fault.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vla.data.layout import (
    ACTION_KEY,
    DATA_GLOB,
    FRAME_COLUMNS,
    INFO_PATH,
    STATE_KEY,
    STATS_PATH,
    TASKS_PATH,
    DatasetError,
    DatasetInfo,
    FeatureSpec,
    VectorStats,
)

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def read_stats(root: Path, info: DatasetInfo) -> dict[str, VectorStats]:
    """``meta/stats.json`` (state and action statistics), checked against ``info``'s vector
    sizes; empty for a dataset written without one."""
    path = root / STATS_PATH
    if not path.is_file():
        return {}
    try:
        stats = msgspec.json.decode(path.read_bytes(), type=dict[str, VectorStats])
    except msgspec.DecodeError as exc:
        raise DatasetError(f"{STATS_PATH}: {exc}") from exc
    for key, entry in stats.items():
        feature = info.features.get(key)
        if feature is None:
            raise DatasetError(f"{STATS_PATH}: {key!r} is not a feature of {INFO_PATH}")
        size = feature.shape[0] if len(feature.shape) == 1 else -1
        for name in ("mean", "std", "min", "max"):
            values = getattr(entry, name)
            if len(values) != size or not all(math.isfinite(v) for v in values):
                raise DatasetError(
                    f"{STATS_PATH}: {key}.{name} must be {size} finite numbers, got "
                    f"{len(values)} values"
                )
            # The head keeps them in float32: past its range one would become inf there,
            # and every normalised value 0 (or NaN), with no error anywhere.
            for i, v in enumerate(values):
                if abs(v) > _FLOAT32_MAX:
                    raise DatasetError(
                        f"{STATS_PATH}: {key}.{name}[{i}] = {v:g} is beyond float32's range"
                    )
        if any(v < 0 for v in entry.std):
            raise DatasetError(f"{STATS_PATH}: {key}.std has a negative value")
        for i, (low, high) in enumerate(zip(entry.min, entry.max, strict=True)):
            if low > high:
                raise DatasetError(
                    f"{STATS_PATH}: {key}.min[{i}] = {low:g} is above {key}.max[{i}] = {high:g}"
                )
    return stats


def read_info(root: Path) -> DatasetInfo:
    """``meta/info.json``, with the state, action and camera features it must declare."""
    if not root.is_dir():
        raise DatasetError(f"{root}: not a dataset directory")
    path = root / INFO_PATH
    if not path.is_file():
        raise DatasetError(f"{root}: missing {INFO_PATH}")
    try:
        info = msgspec.json.decode(path.read_bytes(), type=DatasetInfo)
    except msgspec.DecodeError as exc:  # msgspec names the field: "... at `$.fps`"
        raise DatasetError(f"{INFO_PATH}: {exc}") from exc
    for key in (STATE_KEY, ACTION_KEY, *info.camera_keys):
        if key not in info.features:
            raise DatasetError(f"{INFO_PATH}: features has no {key!r}")
    for key in (STATE_KEY, ACTION_KEY):
        if len(info.features[key].shape) != 1:
            raise DatasetError(
                f"{INFO_PATH}: feature {key!r} must be a vector (one dimension), got shape "
                f"{tuple(info.features[key].shape)}"
            )
    camera_shapes = {key: tuple(info.features[key].shape) for key in info.camera_keys}
    for key, shape in camera_shapes.items():
        if len(shape) != 3 or shape[2] != 3 or min(shape) < 1:
            raise DatasetError(
                f"{INFO_PATH}: camera {key!r} must have shape (height, width, 3), got {shape}"
            )
    if len(set(camera_shapes.values())) > 1:
        # A sample's views are one (V, H, W, 3) array: found here, not at the first batch.
        raise DatasetError(f"{INFO_PATH}: cameras have different image shapes {camera_shapes}")
    return info


def read_table(path: Path, root: Path, required: Sequence[str]) -> pa.Table:
    """A parquet file of the dataset, with ``required`` columns present."""
    rel = path.relative_to(root).as_posix()
    if not path.is_file():
        raise DatasetError(f"{root}: missing {rel}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{rel}: unreadable parquet file: {exc}") from exc
    missing = [name for name in required if name not in table.column_names]
    if missing:
        raise DatasetError(f"{rel}: missing column {', '.join(repr(m) for m in missing)}")
    return table


def read_tasks(root: Path) -> dict[int, str]:
    """``meta/tasks.parquet`` as task_index -> task text."""
    table = read_table(root / TASKS_PATH, root, ["task_index", "task"])
    task_ids = ints(table, "task_index", TASKS_PATH).tolist()
    tasks = dict(zip(task_ids, table.column("task").to_pylist(), strict=True))
    if len(tasks) != len(task_ids):
        raise DatasetError(f"{TASKS_PATH}: duplicate task_index")
    return tasks


def data_paths(root: Path) -> list[Path]:
    """The data files in frame order (the names sort as chunk, then file)."""
    paths = sorted(root.glob(DATA_GLOB))
    if not paths:
        raise DatasetError(f"{root}: no data files (data/chunk-*/file-*.parquet)")
    return paths


def data_columns(info: DatasetInfo) -> list[str]:
    """The columns every data file must have."""
    return [*FRAME_COLUMNS, STATE_KEY, ACTION_KEY, *info.camera_keys]


def read_data(root: Path, info: DatasetInfo) -> pa.Table:
    """Every data file, joined in frame order; their schemas must agree."""
    paths = data_paths(root)
    tables = [read_table(path, root, data_columns(info)) for path in paths]
    for path, table in zip(paths[1:], tables[1:], strict=True):
        if not table.schema.equals(tables[0].schema, check_metadata=False):
            raise DatasetError(
                f"{path.relative_to(root).as_posix()}: schema differs from "
                f"{paths[0].relative_to(root).as_posix()}"
            )
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def ints(table: pa.Table, name: str, where: str = "column") -> np.ndarray:
    """An integer column without nulls as int64."""
    column = table.column(name)
    if not pa.types.is_integer(column.type):
        raise DatasetError(f"{where} {name!r}: expected integers, got {column.type}")
    if column.null_count:
        raise DatasetError(f"{where} {name!r}: {column.null_count} null values")
    return np.asarray(column.to_numpy(), dtype=np.int64)


def check_vector_type(name: str, kind: pa.DataType, spec: FeatureSpec) -> None:
    """A ``list<float>`` type, and its size where the type fixes it, checked against ``spec``."""
    expected = tuple(spec.shape)
    if not (pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind)):
        raise DatasetError(f"column {name!r}: expected list<float32> {expected}, got {kind}")
    if not pa.types.is_floating(kind.value_type):
        raise DatasetError(f"column {name!r}: expected float values, got {kind.value_type}")
    if pa.types.is_fixed_size_list(kind):
        _check_vector_size(name, kind.list_size, expected)


def _check_vector_size(name: str, size: int, expected: tuple[int, ...]) -> None:
    if size != math.prod(expected):
        raise DatasetError(
            f"column {name!r}: {INFO_PATH} declares shape {expected}, data has shape ({size},)"
        )


def vector_column(table: pa.Table, name: str, spec: FeatureSpec) -> np.ndarray:
    """A ``list<float>`` column as float32 ``(N, *spec.shape)``, checked against ``spec``."""
    column = table.column(name)
    expected = tuple(spec.shape)
    kind = column.type
    check_vector_type(name, kind, spec)
    if column.null_count:
        raise DatasetError(f"column {name!r}: {column.null_count} null rows")
    array = column.combine_chunks()
    if not pa.types.is_fixed_size_list(kind):
        lengths = np.unique(pc.list_value_length(array).to_numpy(zero_copy_only=False))
        if lengths.size > 1:
            raise DatasetError(f"column {name!r}: rows have different lengths {lengths.tolist()}")
        _check_vector_size(name, int(lengths[0]) if lengths.size else math.prod(expected), expected)
    values = np.asarray(array.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
    return values.reshape(len(array), *expected)


def check_image_type(key: str, kind: pa.DataType) -> None:
    """PNG bytes travel in a ``binary`` column."""
    if not (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise DatasetError(f"column {key!r}: expected PNG bytes (binary), got {kind}")


def first(mask_N: np.ndarray) -> int:
    """The first row where ``mask_N`` is True."""
    return int(np.flatnonzero(mask_N)[0])
