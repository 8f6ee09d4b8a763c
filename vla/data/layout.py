"""The on-disk layout of a dataset: paths, column names and the ``meta/`` records.

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
(the one taken at that frame), so any action chunk length can be sampled later. Images are
PNG bytes in a ``binary`` column per camera (see :mod:`vla.data.png`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

CODEBASE_VERSION = "v3.0"
INFO_PATH = "meta/info.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_PATH = "meta/episodes.parquet"
#: Per-dimension statistics of the vector features (LeRobot's ``meta/stats.json``).
STATS_PATH = "meta/stats.json"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
#: Where :data:`DATA_PATH` files are found, relative to the dataset root.
DATA_GLOB = "data/chunk-*/file-*.parquet"
STATE_KEY = "observation.state"
ACTION_KEY = "action"
IMAGE_PREFIX = "observation.images."
#: Data files per chunk directory (LeRobot's default).
CHUNKS_SIZE = 1000
#: The integer/float bookkeeping columns of every data file.
FRAME_COLUMNS = ("episode_index", "frame_index", "timestamp", "index", "task_index")


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


class VectorStats(msgspec.Struct, frozen=True):
    """Per-dimension statistics of a vector feature over all frames (``meta/stats.json``)."""

    mean: list[float]
    std: list[float]
    min: list[float]
    max: list[float]
    #: Frames counted.
    count: int


@dataclass(frozen=True)
class EpisodeMeta:
    """One row of ``meta/episodes.parquet``; frames are rows ``[from_index, to_index)``."""

    episode_index: int
    length: int
    task: str
    success: bool | None
    from_index: int
    to_index: int
