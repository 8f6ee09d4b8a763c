"""The env worker's side of offline datasets: recording a scripted expert, SFT micro-batches.

The on-disk format -- layout, PNG codec, writer, reader and validators, summary -- is
:mod:`vla.data`, which the master (checking a dataset at submit) shares without importing
this role.
"""

from services.envs.datasets.loaded import LoadedDatasets, directory_version
from services.envs.datasets.recorder import record
from services.envs.datasets.sampler import Batch, iter_batches

__all__ = ["Batch", "LoadedDatasets", "directory_version", "iter_batches", "record"]
