"""Offline robot datasets in a LeRobot-v3-style layout, read and written with pyarrow only.

The on-disk format, shared by every role that touches a dataset (the master checks one at
submit, env workers stream it, the CLI and benchmarks record and inspect it):

* :mod:`vla.data.layout` -- paths, columns, the ``meta/`` records, :class:`DatasetError`;
* :mod:`vla.data.png` -- the image codec;
* :mod:`vla.data.writer` -- :func:`write_dataset`;
* :mod:`vla.data.reader` -- checked readers of the files;
* :mod:`vla.data.meta` -- :class:`DatasetMeta` and :func:`check_dataset`, the submit-time
  check from metadata and a sample;
* :mod:`vla.data.dataset` -- :func:`load_dataset`, the full validation into memory;
* :mod:`vla.data.summary` -- :func:`inspect`.

Recording a simulator's scripted expert and sampling SFT micro-batches are the env worker's
(``services.envs.datasets``). Nothing here imports torch.
"""

from vla.data.dataset import Dataset, load_dataset
from vla.data.layout import (
    ACTION_KEY,
    CODEBASE_VERSION,
    EPISODES_PATH,
    IMAGE_PREFIX,
    INFO_PATH,
    STATE_KEY,
    STATS_PATH,
    TASKS_PATH,
    DatasetError,
    DatasetInfo,
    EpisodeMeta,
    FeatureSpec,
    VectorStats,
)
from vla.data.meta import DatasetMeta, check_dataset, read_meta
from vla.data.summary import DatasetSummary, TaskSummary, inspect
from vla.data.writer import EpisodeRecord, write_dataset

__all__ = [
    "ACTION_KEY",
    "CODEBASE_VERSION",
    "EPISODES_PATH",
    "IMAGE_PREFIX",
    "INFO_PATH",
    "STATE_KEY",
    "STATS_PATH",
    "TASKS_PATH",
    "Dataset",
    "DatasetError",
    "DatasetInfo",
    "DatasetMeta",
    "DatasetSummary",
    "EpisodeMeta",
    "EpisodeRecord",
    "FeatureSpec",
    "TaskSummary",
    "VectorStats",
    "check_dataset",
    "inspect",
    "load_dataset",
    "read_meta",
    "write_dataset",
]
