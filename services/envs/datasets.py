"""Offline robot datasets in a LeRobot-v3-style layout, read and written with pyarrow only.

Layout of a dataset directory::

    meta/info.json                     codebase_version, fps, features {name: {dtype, shape}},
                                       total_episodes, total_frames, camera_keys, ...
    meta/tasks.parquet                 task_index, task
    meta/episodes.parquet              episode_index, length, task, task_index, success,
                                       dataset_from_index, dataset_to_index,
                                       data/chunk_index, data/file_index
    data/chunk-000/file-000.parquet    one row per frame: episode_index, frame_index,
                                       timestamp, index, task_index, observation.state,
                                       action, observation.images.<cam>

``observation.state`` and ``action`` are ``fixed_size_list<float32>``; one action per frame
(the one taken at that frame), so any action chunk length can be sampled later.

Images are PNG bytes in a ``binary`` column per camera, where LeRobot v3 uses MP4 videos. Our
frames are small synthetic images: PNG is lossless (the policy trains on exactly what the
simulator rendered), gives random access by row without seeking a video decoder, and costs a
few hundred bytes per 64x64 frame. We write PNGs without row filters, which decode with one
``zlib`` call; PNGs written by other tools are decoded by Pillow.

:func:`load_dataset` validates everything it relies on and raises :class:`DatasetError` naming
the file, column, episode or frame at fault; it decodes every image once and, within a memory
budget, keeps them decoded, so sampling batches is array indexing.
"""

from __future__ import annotations

import io
import math
import os
import shutil
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image

CODEBASE_VERSION = "v3.0"
INFO_PATH = "meta/info.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_PATH = "meta/episodes.parquet"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
STATE_KEY = "observation.state"
ACTION_KEY = "action"
IMAGE_PREFIX = "observation.images."
#: Data files per chunk directory (LeRobot's default).
CHUNKS_SIZE = 1000
_FRAME_COLUMNS = ("episode_index", "frame_index", "timestamp", "index", "task_index")
# What Pillow raises for a corrupt PNG (UnidentifiedImageError is an OSError).
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, zlib.error, struct.error)


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file, column, episode or frame."""


class FeatureSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """One feature of ``meta/info.json``: numpy dtype (``"image"`` for cameras) and shape."""

    dtype: str
    shape: tuple[int, ...]
    names: list[str] | None = None


class DatasetInfo(msgspec.Struct, frozen=True):
    """The contents of ``meta/info.json``."""

    codebase_version: str
    fps: int
    features: dict[str, FeatureSpec]
    total_episodes: int
    total_frames: int
    total_tasks: int
    #: Image feature names, e.g. ``["observation.images.front"]``, in view order.
    camera_keys: list[str]
    robot_type: str = "unknown"
    chunks_size: int = CHUNKS_SIZE
    data_path: str = DATA_PATH
    #: The gymnasium id the dataset was recorded in, if any.
    env_id: str | None = None
    #: Who produced the actions, e.g. ``"scripted_expert"``.
    source: str | None = None


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


@dataclass(frozen=True)
class EpisodeMeta:
    """One row of ``meta/episodes.parquet``; frames are rows ``[from_index, to_index)``."""

    episode_index: int
    length: int
    task: str
    success: bool | None
    from_index: int
    to_index: int


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


@dataclass(frozen=True)
class TaskSummary:
    task_index: int
    task: str
    episodes: int


@dataclass(frozen=True)
class DatasetSummary:
    """What :func:`inspect` reports; :meth:`format` renders it for people."""

    root: str
    codebase_version: str
    fps: int
    total_episodes: int
    total_frames: int
    features: dict[str, FeatureSpec]
    camera_keys: list[str]
    tasks: list[TaskSummary]
    episode_length_min: int
    episode_length_mean: float
    episode_length_max: int
    action_min: list[float]
    action_max: list[float]
    action_mean: list[float]
    #: Fraction of episodes marked successful, over those with a recorded outcome.
    success_rate: float | None
    env_id: str | None = None

    def format(self) -> str:
        """A human-readable multi-line report."""

        def vec(values: list[float]) -> str:
            return "[" + ", ".join(f"{v:+.3f}" for v in values) + "]"

        lines = [
            f"dataset   {self.root}  ({self.codebase_version})",
            f"episodes  {self.total_episodes}   frames {self.total_frames}   fps {self.fps}"
            + (f"   env {self.env_id}" if self.env_id else ""),
            f"length    min {self.episode_length_min}  mean {self.episode_length_mean:.1f}"
            f"  max {self.episode_length_max}",
            "features",
        ]
        for name, spec in self.features.items():
            lines.append(f"  {name:<28} {spec.dtype:<8} {tuple(spec.shape)}")
        lines.append(f"tasks     {len(self.tasks)}")
        for task in self.tasks:
            lines.append(f"  [{task.task_index}] {task.task!r}  ({task.episodes} episodes)")
        lines.append(f"action    min {vec(self.action_min)}")
        lines.append(f"          max {vec(self.action_max)}")
        lines.append(f"          mean {vec(self.action_mean)}")
        rate = "not recorded" if self.success_rate is None else f"{self.success_rate:.1%}"
        lines.append(f"success   {rate}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Writing


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def _encode_png(image_H_W_3: np.ndarray) -> bytes:
    """A standard 8-bit RGB PNG whose rows all use filter 0 (None).

    Written by hand rather than with Pillow: filter 0 lets :func:`_decode_png` decode with a
    single ``zlib.decompress`` and a reshape (~4x faster than Pillow), and flat synthetic
    frames compress just as well without PNG's row filters. Any PNG reader can open it.
    """
    height, width, _ = image_H_W_3.shape
    rows_H_R = np.zeros((height, 1 + 3 * width), np.uint8)  # column 0: the filter byte
    rows_H_R[:, 1:] = image_H_W_3.reshape(height, 3 * width)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        _PNG_SIGNATURE
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(rows_H_R.tobytes(), 6))
        + _png_chunk(b"IEND", b"")
    )


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
                *[pa.array(map(_encode_png, ep.images[cam]), pa.binary()) for cam in cams],
            ]
            writer.write_table(pa.Table.from_arrays(columns, schema=schema))
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
        **{name: FeatureSpec("int64", (1,)) for name in _FRAME_COLUMNS if name != "timestamp"},
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
    return info


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
        expected = (length, *first.images[cam].shape[1:])
        if frames.dtype != np.uint8 or frames.shape != expected or frames.shape[-1] != 3:
            raise DatasetError(
                f"{where}: camera {cam!r} frames are {frames.dtype} {frames.shape}, "
                f"expected uint8 {expected} with 3 channels"
            )


def record(
    env_id: str,
    episodes: int,
    out_dir: str | os.PathLike[str],
    seed: int,
    max_steps: int | None = None,
    *,
    env_kwargs: Mapping[str, Any] | None = None,
    camera: str = "front",
    overwrite: bool = False,
) -> DatasetInfo:
    """Record ``episodes`` episodes of the env's scripted expert as a dataset at ``out_dir``.

    Episode ``i`` starts from ``env.reset(seed=seed + i)``, so a dataset is reproducible from
    ``(env_id, env_kwargs, seed)``. The env must return dict observations with ``image``
    (uint8 HxWx3, stored as camera ``camera``), ``state`` and ``instruction`` (the task), and
    its unwrapped env must have ``expert_action() -> action``. ``max_steps`` replaces the
    env's registered time limit. Each frame stores the observation and the one action taken
    there; success comes from the final ``info["is_success"]``.
    """
    from services.envs.sims import make_env  # here, so reading datasets needs no simulator

    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    kwargs = dict(env_kwargs or {})
    if max_steps is not None:
        kwargs["max_episode_steps"] = max_steps
    env = make_env(env_id, **kwargs)
    try:
        expert: Callable[[], np.ndarray] | None = getattr(env.unwrapped, "expert_action", None)
        if expert is None:
            raise DatasetError(f"{env_id} has no scripted expert (env.unwrapped.expert_action)")
        limit = max_steps or (env.spec.max_episode_steps if env.spec else None)
        if limit is None:
            raise ValueError(f"{env_id} has no time limit; pass max_steps")
        fps = int(env.metadata.get("render_fps") or 10)

        def run(episode_index: int) -> EpisodeRecord:
            obs, info = env.reset(seed=seed + episode_index)
            if not isinstance(obs, Mapping) or not {"image", "state"} <= obs.keys():
                raise DatasetError(f"{env_id}: record needs dict observations with image, state")
            task = str(obs.get("instruction") or env_id)
            states, actions, images = [], [], []
            for _ in range(limit):
                action = np.asarray(expert(), dtype=np.float32)
                states.append(obs["state"])
                images.append(obs["image"])
                actions.append(action)
                obs, _, terminated, truncated, info = env.step(action)
                if terminated or truncated:
                    break
            success = info.get("is_success")
            return EpisodeRecord(
                task=task,
                state_T_S=np.stack(states).astype(np.float32),
                action_T_A=np.stack(actions),
                images={camera: np.stack(images)},
                success=None if success is None else bool(success),
            )

        return write_dataset(
            out_dir,
            (run(i) for i in range(episodes)),
            fps,
            robot_type=env_id,
            env_id=env_id,
            source="scripted_expert",
            overwrite=overwrite,
        )
    finally:
        env.close()


# ---------------------------------------------------------------------------------------
# Reading and validation


def _read_info(root: Path) -> DatasetInfo:
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
    return info


def _read_table(path: Path, root: Path, required: Sequence[str]) -> pa.Table:
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


def _read_data(root: Path, info: DatasetInfo) -> pa.Table:
    paths = sorted((root / "data").glob("chunk-*/file-*.parquet"))
    if not paths:
        raise DatasetError(f"{root}: no data files (data/chunk-*/file-*.parquet)")
    required = [*_FRAME_COLUMNS, STATE_KEY, ACTION_KEY, *info.camera_keys]
    tables = [_read_table(path, root, required) for path in paths]
    for path, table in zip(paths[1:], tables[1:], strict=True):
        if not table.schema.equals(tables[0].schema, check_metadata=False):
            raise DatasetError(
                f"{path.relative_to(root).as_posix()}: schema differs from "
                f"{paths[0].relative_to(root).as_posix()}"
            )
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def _ints(table: pa.Table, name: str, where: str = "column") -> np.ndarray:
    column = table.column(name)
    if not pa.types.is_integer(column.type):
        raise DatasetError(f"{where} {name!r}: expected integers, got {column.type}")
    if column.null_count:
        raise DatasetError(f"{where} {name!r}: {column.null_count} null values")
    return np.asarray(column.to_numpy(), dtype=np.int64)


def _vector_column(table: pa.Table, name: str, spec: FeatureSpec) -> np.ndarray:
    """A ``list<float>`` column as float32 ``(N, *spec.shape)``, checked against ``spec``."""
    column = table.column(name)
    expected = tuple(spec.shape)
    kind = column.type
    if not (pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind)):
        raise DatasetError(f"column {name!r}: expected list<float32> {expected}, got {kind}")
    if not pa.types.is_floating(kind.value_type):
        raise DatasetError(f"column {name!r}: expected float values, got {kind.value_type}")
    if column.null_count:
        raise DatasetError(f"column {name!r}: {column.null_count} null rows")
    array = column.combine_chunks()
    if pa.types.is_fixed_size_list(kind):
        size = kind.list_size
    else:
        lengths = np.unique(pc.list_value_length(array).to_numpy(zero_copy_only=False))
        if lengths.size > 1:
            raise DatasetError(f"column {name!r}: rows have different lengths {lengths.tolist()}")
        size = int(lengths[0]) if lengths.size else math.prod(expected)
    if size != math.prod(expected):
        raise DatasetError(
            f"column {name!r}: {INFO_PATH} declares shape {expected}, data has shape ({size},)"
        )
    values = np.asarray(array.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
    return values.reshape(len(array), *expected)


def _decode_fast(data: bytes, shape: tuple[int, ...]) -> np.ndarray | None:
    """Decode a PNG as :func:`_encode_png` writes it; ``None`` for any other kind of PNG.

    The size is checked against ``shape`` before inflating, and inflating is capped, so a
    tenant's malformed or hostile file cannot make us allocate more than one frame.
    """
    if not data.startswith(_PNG_SIGNATURE):
        raise ValueError("not a PNG (bad signature)")
    pos, header, idat = len(_PNG_SIGNATURE), None, []
    while pos + 8 <= len(data):
        (size,) = struct.unpack_from(">I", data, pos)
        tag = data[pos + 4 : pos + 8]
        if tag == b"IHDR":
            header = struct.unpack_from(">IIBBBBB", data, pos + 8)
        elif tag == b"IDAT":
            idat.append(data[pos + 8 : pos + 8 + size])
        elif tag == b"IEND":
            break
        pos += size + 12
    if header is None or header[2:] != (8, 2, 0, 0, 0):
        return None
    width, height = header[0], header[1]
    _check_size(height, width, shape)
    expected = height * (1 + 3 * width)
    inflater = zlib.decompressobj()
    raw = inflater.decompress(b"".join(idat), expected + 1)
    if len(raw) != expected or not inflater.eof:
        raise ValueError(f"truncated or oversized pixel data ({len(raw)} of {expected} bytes)")
    rows_H_R = np.frombuffer(raw, np.uint8).reshape(height, 1 + 3 * width)
    if rows_H_R[:, 0].any():  # row filters in use: leave the unfiltering to Pillow
        return None
    return rows_H_R[:, 1:].reshape(height, width, 3)


def _check_size(height: int, width: int, shape: tuple[int, ...]) -> None:
    if (height, width, 3) != shape:
        raise ValueError(f"image has shape {(height, width, 3)}, {INFO_PATH} declares {shape}")


def _decode_png(data: bytes, shape: tuple[int, ...], key: str, where: str) -> np.ndarray:
    """One frame as uint8 ``shape``; :class:`DatasetError` naming ``key`` and ``where`` if not."""
    try:
        image_H_W_3 = _decode_fast(data, shape)
        if image_H_W_3 is None:
            with Image.open(io.BytesIO(data)) as image:
                _check_size(image.height, image.width, shape)  # before decoding any pixels
                image_H_W_3 = np.asarray(image.convert("RGB"))
    except _DECODE_ERRORS as exc:
        raise DatasetError(f"column {key!r}: unreadable image at {where}: {exc}") from exc
    return image_H_W_3


def _first(mask_N: np.ndarray) -> int:
    return int(np.flatnonzero(mask_N)[0])


class Dataset:
    """A validated dataset held in memory, with deterministic SFT batch sampling.

    Rows are frames in ``index`` order; per-frame arrays are named with an ``_N`` suffix.
    Build one with :func:`load_dataset`.
    """

    def __init__(
        self,
        root: Path,
        info: DatasetInfo,
        tasks: dict[int, str],
        episodes: list[EpisodeMeta],
        table: pa.Table,
        *,
        verify_images: bool,
        image_cache_mb: float,
    ) -> None:
        self.root = root
        self.info = info
        #: task_index -> task text (the instruction).
        self.tasks = tasks
        self.episodes = episodes
        self.episode_index_N = _ints(table, "episode_index")
        self.frame_index_N = _ints(table, "frame_index")
        self.task_index_N = _ints(table, "task_index")
        self.state_N_S = _vector_column(table, STATE_KEY, info.features[STATE_KEY])
        self.action_N_A = _vector_column(table, ACTION_KEY, info.features[ACTION_KEY])
        self._by_episode = {ep.episode_index: ep for ep in episodes}
        # Exclusive end row of each frame's episode: where action chunks stop.
        self._episode_end_N = np.repeat(
            np.array([ep.to_index for ep in episodes], np.int64),
            np.array([ep.length for ep in episodes], np.int64),
        )
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
    def num_episodes(self) -> int:
        return len(self.episodes)

    @property
    def camera_keys(self) -> tuple[str, ...]:
        return tuple(self.info.camera_keys)

    def _where(self, row: int) -> str:
        return f"episode {self.episode_index_N[row]}, frame {self.frame_index_N[row]}"

    def _check_values(self) -> None:
        for name, values in ((ACTION_KEY, self.action_N_A), (STATE_KEY, self.state_N_S)):
            bad_N = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
            if bad_N.any():
                row = _first(bad_N)
                raise DatasetError(
                    f"column {name!r}: non-finite value {values[row].tolist()} at "
                    f"{self._where(row)}"
                )
        known = np.array(sorted(self.tasks), np.int64)
        unknown_N = ~np.isin(self.task_index_N, known)
        if unknown_N.any():
            row = _first(unknown_N)
            raise DatasetError(
                f"task_index {self.task_index_N[row]} at {self._where(row)} is not in "
                f"{TASKS_PATH} (known: {known.tolist()})"
            )

    def _png_column(self, table: pa.Table, key: str) -> list[bytes]:
        column = table.column(key)
        if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
            raise DatasetError(f"column {key!r}: expected PNG bytes (binary), got {column.type}")
        if column.null_count:
            row = _first(np.asarray(column.is_null().to_numpy(zero_copy_only=False)))
            raise DatasetError(f"column {key!r}: missing image at {self._where(row)}")
        return column.to_pylist()

    def _decode(self, key: str, rows_B: np.ndarray) -> np.ndarray:
        expected = tuple(self.info.features[key].shape)
        out_B_H_W_3 = np.empty((len(rows_B), *expected), np.uint8)
        for i, row in enumerate(rows_B.tolist()):
            out_B_H_W_3[i] = _decode_png(self._png[key][row], expected, key, self._where(row))
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

    def _rows(self, episodes: Iterable[int] | None) -> np.ndarray:
        if episodes is None:
            return np.arange(len(self), dtype=np.int64)
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
        """Batches per epoch that :meth:`iter_batches` yields with the same arguments."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        frames = len(self._rows(episodes))
        return frames // batch_size if drop_last else -(-frames // batch_size)

    def iter_batches(
        self,
        batch_size: int,
        chunk_len: int = 1,
        seed: int = 0,
        epoch: int = 0,
        episodes: Iterable[int] | None = None,
        *,
        drop_last: bool = False,
        start_batch: int = 0,
    ) -> Iterator[Batch]:
        """Shuffled micro-batches over the frames of ``episodes`` (default: all).

        The order is a permutation drawn from ``(seed, epoch)``: the same pair gives the same
        batches, another epoch another order, and one epoch visits every frame exactly once
        (the last batch is smaller unless ``drop_last``). ``start_batch`` resumes an epoch.
        """
        if chunk_len < 1:
            raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
        count = self.num_batches(batch_size, episodes, drop_last=drop_last)
        rows_R = self._rows(episodes)
        order_R = rows_R[np.random.default_rng([seed, epoch]).permutation(len(rows_R))]
        offsets_C = np.arange(chunk_len, dtype=np.int64)
        for batch_index in range(start_batch, count):
            rows_B = order_R[batch_index * batch_size : (batch_index + 1) * batch_size]
            end_B = self._episode_end_N[rows_B]
            ahead_B_C = rows_B[:, None] + offsets_C
            pad_B_C = ahead_B_C >= end_B[:, None]
            ahead_B_C = np.minimum(ahead_B_C, end_B[:, None] - 1)
            yield Batch(
                epoch=epoch,
                batch_index=batch_index,
                index_B=rows_B,  # rows are validated to equal the `index` column
                episode_index_B=self.episode_index_N[rows_B],
                frame_index_B=self.frame_index_N[rows_B],
                camera_keys=self.camera_keys,
                images_B_V_H_W_3=self.images(rows_B),
                state_B_S=self.state_N_S[rows_B],
                instructions=[self.tasks[t] for t in self.task_index_N[rows_B].tolist()],
                actions_B_C_A=self.action_N_A[ahead_B_C],
                action_pad_B_C=pad_B_C,
            )


def _episode_metas(
    table: pa.Table, info: DatasetInfo, episode_index_N: np.ndarray, frame_index_N: np.ndarray
) -> list[EpisodeMeta]:
    """Check that frames form contiguous, ordered episodes matching ``meta/episodes.parquet``."""
    n = len(frame_index_N)
    # Row where each run of equal episode_index starts (n >= 1 is checked by the caller).
    starts_E = np.flatnonzero(np.r_[True, episode_index_N[1:] != episode_index_N[:-1]])
    ids_E = episode_index_N[starts_E]
    if (np.diff(ids_E) <= 0).any():
        e = _first(np.diff(ids_E) <= 0)
        raise DatasetError(
            f"column 'episode_index': episode {ids_E[e + 1]} follows episode {ids_E[e]}; "
            "episodes must be contiguous and in increasing order"
        )
    lengths_E = np.diff(np.r_[starts_E, n])
    expected_N = np.arange(n) - np.repeat(starts_E, lengths_E)
    if (frame_index_N != expected_N).any():
        row = _first(frame_index_N != expected_N)
        raise DatasetError(
            f"column 'frame_index': episode {episode_index_N[row]} has frame_index "
            f"{frame_index_N[row]} at position {expected_N[row]}; expected 0..length-1 in order"
        )
    meta_ids = _ints(table, "episode_index", EPISODES_PATH)
    meta_lengths = _ints(table, "length", EPISODES_PATH)
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
    info = _read_info(path)
    tasks_table = _read_table(path / TASKS_PATH, path, ["task_index", "task"])
    task_ids = _ints(tasks_table, "task_index", TASKS_PATH).tolist()
    tasks = dict(zip(task_ids, tasks_table.column("task").to_pylist(), strict=True))
    if len(tasks) != len(task_ids):
        raise DatasetError(f"{TASKS_PATH}: duplicate task_index")
    episodes_table = _read_table(path / EPISODES_PATH, path, ["episode_index", "length", "task"])
    table = _read_data(path, info)
    index_N = _ints(table, "index")
    if len(index_N) == 0:
        raise DatasetError(f"{path}: the data files have no frames")
    if (index_N != np.arange(len(index_N))).any():
        row = _first(index_N != np.arange(len(index_N)))
        raise DatasetError(
            f"column 'index': row {row} has index {index_N[row]}; frames must be numbered "
            "0..N-1 in file order"
        )
    episodes = _episode_metas(
        episodes_table, info, _ints(table, "episode_index"), _ints(table, "frame_index")
    )
    known = set(tasks.values())
    for ep in episodes:
        if ep.task not in known:
            raise DatasetError(f"episode {ep.episode_index}: task {ep.task!r} not in {TASKS_PATH}")
    return Dataset(
        path,
        info,
        tasks,
        episodes,
        table,
        verify_images=verify_images,
        image_cache_mb=image_cache_mb,
    )


def inspect(root: str | os.PathLike[str]) -> DatasetSummary:
    """Validate the dataset at ``root`` and summarise it (see :meth:`DatasetSummary.format`)."""
    ds = load_dataset(root)
    lengths = np.array([ep.length for ep in ds.episodes])
    outcomes = [ep.success for ep in ds.episodes if ep.success is not None]
    task_of = {task: index for index, task in ds.tasks.items()}
    per_task = {index: 0 for index in ds.tasks}
    for ep in ds.episodes:
        per_task[task_of[ep.task]] += 1
    action_N_A = ds.action_N_A.reshape(len(ds), -1)
    return DatasetSummary(
        root=str(ds.root),
        codebase_version=ds.info.codebase_version,
        fps=ds.info.fps,
        total_episodes=ds.num_episodes,
        total_frames=len(ds),
        features=dict(ds.info.features),
        camera_keys=list(ds.camera_keys),
        tasks=[TaskSummary(i, ds.tasks[i], per_task[i]) for i in sorted(ds.tasks)],
        episode_length_min=int(lengths.min()),
        episode_length_mean=float(lengths.mean()),
        episode_length_max=int(lengths.max()),
        action_min=action_N_A.min(axis=0).tolist(),
        action_max=action_N_A.max(axis=0).tolist(),
        action_mean=action_N_A.mean(axis=0).tolist(),
        success_rate=float(np.mean(outcomes)) if outcomes else None,
        env_id=ds.info.env_id,
    )
