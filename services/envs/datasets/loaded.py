"""The datasets an env worker keeps loaded, by what they hold: a pushed dataset by its
manifest's digest, a registered directory by when it was registered and last written (an
operator may re-record it in place)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from vla.data import Dataset

#: Datasets a worker keeps loaded (the least recently used beyond it are dropped).
MAX_DATASETS = 8


def directory_version(path: Path, registered_at: float) -> str:
    """What tells one content of a registered dataset directory from the next: when it was
    registered and when its metadata was last written (re-recorded in place, it changes)."""
    try:
        written = (path / "meta" / "info.json").stat().st_mtime_ns
    except OSError:
        written = 0
    return f"{path}@{registered_at}@{written}"


class LoadedDatasets:
    """At most :data:`MAX_DATASETS` loaded datasets, the least recently used dropped first."""

    def __init__(self, capacity: int = MAX_DATASETS) -> None:
        self.capacity = capacity
        self._loaded: OrderedDict[tuple[str, str, str], Dataset] = OrderedDict()

    def get(self, tenant: str, dataset_id: str, version: str) -> Dataset | None:
        key = (tenant, dataset_id, version)
        found = self._loaded.get(key)
        if found is not None:
            self._loaded.move_to_end(key)
        return found

    def put(self, tenant: str, dataset_id: str, version: str, dataset: Dataset) -> None:
        self._loaded[(tenant, dataset_id, version)] = dataset
        while len(self._loaded) > self.capacity:
            self._loaded.popitem(last=False)

    def __len__(self) -> int:
        return len(self._loaded)
