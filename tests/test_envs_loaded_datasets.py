"""An env worker's loaded datasets follow what is on disk: a registered directory the
operator re-records in place is loaded again (before, the first load was served for ever),
and only the most recently used few stay in memory."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from nats.js import JetStreamContext

from bus.datacache import DatasetCache
from services.envs.datasets import LoadedDatasets, record
from services.envs.service import EnvWorker
from services.envs.sims import REACH2D_ID, REACH_GRASP_ID
from tests.helpers import uid
from tests.sft_helpers import registered
from vla.data import load_dataset


async def test_a_dataset_recorded_again_in_place_is_loaded_again(
    js: JetStreamContext, tmp_path: Path
) -> None:
    path = tmp_path / "demo"
    record(REACH2D_ID, 4, path, seed=0)
    tenant = uid("acme")
    dataset = await registered(js, tenant, path)
    worker = EnvWorker(js, {}, dataset_cache=DatasetCache(tmp_path / "cache"))
    first = await worker.dataset(tenant, dataset)
    assert await worker.dataset(tenant, dataset) is first  # unchanged: loaded once
    shutil.rmtree(path)
    record(REACH_GRASP_ID, 6, path, seed=5)
    await registered(js, tenant, path, dataset)
    again = await worker.dataset(tenant, dataset)
    on_disk = load_dataset(path)
    assert again is not first and again.num_episodes == on_disk.num_episodes == 6
    np.testing.assert_array_equal(again.action_N_A, on_disk.action_N_A)


def test_only_the_most_recently_used_datasets_stay_loaded() -> None:
    loaded = LoadedDatasets(capacity=2)
    marker = [object(), object(), object()]
    for i, m in enumerate(marker):
        if i == 2:
            assert loaded.get("t", "d0", "v") is marker[0]  # d0 used again: d1 goes first
        loaded.put("t", f"d{i}", "v", m)  # type: ignore[arg-type]
    assert len(loaded) == 2
    assert loaded.get("t", "d1", "v") is None
    assert loaded.get("t", "d0", "v") is marker[0] and loaded.get("t", "d2", "v") is marker[2]
