"""SFT end to end on a real stack: master, env worker and trainer as processes."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from nats.js import JetStreamContext

from bus.server import EmbeddedServer
from clients.sdk import Client, JobFailed
from tests.conftest import Procs
from tests.helpers import start_service, uid
from tests.sft_helpers import (
    DISCRETE_3D,
    OFT_2D,
    final_policy,
    follow,
    record_datasets,
    registered,
    sft_spec,
    start_stack,
)
from vla.data import check_dataset, read_meta


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return record_datasets(tmp_path_factory.mktemp("datasets"))


@pytest.mark.timeout(400)
async def test_two_tenants_sft_concurrently_match_their_solo_runs(
    nats_server: EmbeddedServer,
    js: JetStreamContext,
    datasets: dict[str, Path],
    procs: Procs,
    tmp_path: Path,
) -> None:
    start_stack(nats_server.url, tmp_path / "logs", procs)
    steps = 30
    a, b = uid("arm"), uid("gripper")
    spec_a = sft_spec(a, await registered(js, a, datasets["reach"]), OFT_2D, steps)
    spec_b = sft_spec(b, await registered(js, b, datasets["grasp"]), DISCRETE_3D, steps)
    async with await Client.connect(nats_server.url) as client:
        job_a, job_b = await client.train_sft(spec_a), await client.train_sft(spec_b)
        trace_a, trace_b = await asyncio.gather(follow(job_a), follow(job_b))
        result_a, result_b = await job_a.wait(60), await job_b.wait(60)
        assert result_a.status == result_b.status == "succeeded"
        for trace in (trace_a, trace_b):
            assert sorted(trace.losses) == list(range(1, steps + 1))
            first = sum(trace.losses[s] for s in range(1, 6)) / 5
            last = sum(trace.losses[s] for s in range(steps - 4, steps + 1)) / 5
            assert last < 0.8 * first, f"loss did not fall: {first:.4f} -> {last:.4f}"
        rec_a, params_a = await final_policy(client.js, a, job_a.job_id)
        assert rec_a.step == steps and rec_a.batches_done == steps
        # The policy standardises proprio with its dataset's statistics (serving does too).
        stats = read_meta(datasets["reach"]).stats["observation.state"]
        torch.testing.assert_close(params_a["proprio_mean_P"], torch.tensor(stats.mean))
        torch.testing.assert_close(params_a["proprio_std_P"], torch.tensor(stats.std))
        # ... and maps its dataset's action range onto [-1, 1].
        actions = read_meta(datasets["reach"]).stats["action"]
        low, high = torch.tensor(actions.min), torch.tensor(actions.max)
        torch.testing.assert_close(params_a["action_centre_A"], (high + low) / 2)
        torch.testing.assert_close(params_a["action_half_range_A"], (high - low) / 2)

        # The same job alone (same seeds, same data; only the tenant id differs).
        solo = uid("solo")
        job_solo = await client.train_sft(
            sft_spec(solo, await registered(js, solo, datasets["reach"]), OFT_2D, steps)
        )
        trace_solo = await follow(job_solo)
        await job_solo.wait(60)
        _, params_solo = await final_policy(client.js, solo, job_solo.job_id)
    grouped = [trace_a.losses[s] for s in range(1, steps + 1)]
    alone = [trace_solo.losses[s] for s in range(1, steps + 1)]
    assert grouped == pytest.approx(alone, rel=1e-6, abs=1e-7)
    for name, value in params_a.items():
        torch.testing.assert_close(value, params_solo[name], rtol=1e-6, atol=1e-7)


async def test_bad_dataset_is_rejected_at_submit_with_a_specific_error(
    nats_server: EmbeddedServer,
    js: JetStreamContext,
    datasets: dict[str, Path],
    procs: Procs,
    tmp_path: Path,
) -> None:
    start_stack(nats_server.url, tmp_path / "logs", procs)
    tenant = uid("bad")
    async with await Client.connect(nats_server.url) as client:
        missing = await client.train_sft(sft_spec(tenant, "nope", OFT_2D, 5))
        with pytest.raises(
            JobFailed, match=rf"dataset: dataset 'nope' is not in tenant {tenant}'s namespace"
        ):
            await missing.wait(60)
        (tmp_path / "empty").mkdir()
        empty = await client.train_sft(
            sft_spec(tenant, await registered(js, tenant, tmp_path / "empty"), OFT_2D, 5)
        )
        with pytest.raises(JobFailed, match=r"dataset 'empty': .*missing meta/info.json"):
            await empty.wait(60)
        wrong_dim = await client.train_sft(
            sft_spec(tenant, await registered(js, tenant, datasets["reach"]), DISCRETE_3D, 5)
        )
        with pytest.raises(
            JobFailed, match=r"head\.action_dim: 3 does not match the dataset's action dimension 2"
        ):
            await wrong_dim.wait(60)
        # 1024 frames of 64x64x3 are over 8 MiB a batch: refused before any is streamed.
        too_big = await client.train_sft(
            sft_spec(
                tenant, await registered(js, tenant, datasets["reach"]), OFT_2D, 5, batch_size=1024
            )
        )
        with pytest.raises(
            JobFailed,
            match=r"batch_size: 1024 samples of 64x64x3 pixels: up to \d+ bytes a batch exceeds "
            r"max_message_bytes 8388608: use a smaller batch_size",
        ):
            await too_big.wait(60)


async def test_a_bad_frame_the_submit_check_misses_fails_the_job_naming_the_frame(
    nats_server: EmbeddedServer,
    js: JetStreamContext,
    datasets: dict[str, Path],
    procs: Procs,
    tmp_path: Path,
) -> None:
    # The master checks metadata and a sample; the env worker validates every frame.
    root = tmp_path / "late-bad-frame"
    shutil.copytree(datasets["reach"], root)
    data, key = root / "data/chunk-000/file-000.parquet", "observation.images.front"
    table = pq.read_table(data)
    episode_N, frame_N = table["episode_index"].to_numpy(), table["frame_index"].to_numpy()
    images = table[key].to_pylist()
    images[int(np.flatnonzero((episode_N == 14) & (frame_N == 1))[0])] = b"not a png"
    column = pa.array(images, pa.binary())
    pq.write_table(table.set_column(table.schema.get_field_index(key), key, column), data)
    check_dataset(root)  # the sample does not include that frame
    logs = tmp_path / "logs"
    logs.mkdir()
    procs.add(start_service("master", nats_server.url, logs / "master.log"))
    procs.add(start_service("envs", nats_server.url, logs / "envs.log"))
    tenant = uid("frame")
    async with await Client.connect(nats_server.url) as client:
        job = await client.train_sft(
            sft_spec(tenant, await registered(js, tenant, root), OFT_2D, 5)
        )
        with pytest.raises(JobFailed, match=r"unreadable image at episode 14, frame 1") as failed:
            await job.wait(120)
        assert failed.value.result.status == "failed"  # accepted at submit, failed in the env
        kinds = [type(event).__name__ async for event in job.events(idle_timeout=10)]
    assert kinds[0] == "Accepted" and "ErrorEvent" in kinds, kinds


async def test_cancel_mid_run_frees_the_slot(
    nats_server: EmbeddedServer,
    js: JetStreamContext,
    datasets: dict[str, Path],
    procs: Procs,
    tmp_path: Path,
) -> None:
    start_stack(nats_server.url, tmp_path / "logs", procs)
    tenant = uid("cancel")
    async with await Client.connect(nats_server.url) as client:
        job = await client.train_sft(
            sft_spec(tenant, await registered(js, tenant, datasets["reach"]), OFT_2D, 10_000)
        )
        async for ev in job.events(idle_timeout=120):
            if type(ev).__name__ == "Progress":
                break
        await job.cancel("enough")
        with pytest.raises(JobFailed, match="cancelled: enough"):
            await job.wait(60)
        record = await client.status(tenant, job.job_id)
        assert record is not None and record.status == "cancelled"
