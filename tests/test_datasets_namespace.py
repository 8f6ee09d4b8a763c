"""Datasets live in tenants' namespaces: pushed through the tenant's bucket (resumable,
verified by digest) or registered by the operator, and named by id in specs. A path, an
unknown id or another tenant's id is refused; a job starts only from its own tenant's
policies; an exported policy is the checkpoint's bytes."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from nats.js import JetStreamContext

from bus.codec import encode
from bus.connect import connect
from bus.datasets import (
    DatasetStoreError,
    prefix_of,
    push_dataset,
    register_path,
    scan,
    tenant_store,
)
from bus.declare import declare
from bus.server import EmbeddedServer
from clients.sdk import Client, Job, JobFailed, RequestError
from schemas import headers, subjects
from schemas.jobs import JobSubmit
from schemas.tenantctl import AddDataset
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID
from services.master.queries import Queries
from tests.conftest import Procs
from tests.helpers import uid
from tests.sft_helpers import OFT_2D, final_policy, sft_spec, start_stack


class Interrupt(Exception):
    """Stops a push half-way, as a dropped connection or Ctrl-C would."""


@pytest.fixture(scope="module")
def reach(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("datasets") / "reach"
    record(REACH2D_ID, 12, path, seed=0)
    return path


@pytest_asyncio.fixture
async def client(fresh_server: EmbeddedServer, tmp_path: Path) -> AsyncIterator[Client]:
    """A client and the master's responders (in process) on a server of this test alone."""
    nc = await connect(fresh_server.url, name="pytest-master")
    js = nc.jetstream()
    await declare(js)
    queries = Queries(
        js,
        await js.key_value(subjects.KV_JOBS),
        await js.key_value(subjects.KV_POLICIES),
        tmp_path / "master-cache",
    )
    await queries.subscribe(nc)
    async with await Client.connect(fresh_server.url) as c:
        yield c
    await queries.close()
    await nc.close()


async def test_an_interrupted_push_resumes_uploading_only_the_rest(
    client: Client, reach: Path
) -> None:
    tenant = uid("acme")
    files = [f.path for f in scan(reach)]
    assert len(files) >= 4, files
    uploaded: list[str] = []

    def stop_after_two(path: str) -> None:
        uploaded.append(path)
        if len(uploaded) == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        await client.push_dataset(tenant, reach, "reach", on_file=stop_after_two)
    with pytest.raises(RequestError, match="'reach' has no manifest") as unfinished:
        await client.request(tenant, AddDataset(tenant, "reach"))
    assert unfinished.value.code == "not_found"

    pushed = await client.push_dataset(tenant, reach, "reach")
    assert pushed.report.skipped == uploaded, "the files uploaded before the interrupt"
    assert sorted(pushed.report.uploaded) == sorted(set(files) - set(uploaded))
    assert len(pushed.report.uploaded) == len(files) - 2
    record_ = pushed.record
    assert (record_.tenant, record_.dataset, record_.source) == (tenant, "reach", "pushed")
    assert record_.files == len(files) and record_.bytes == sum(f.size for f in scan(reach))
    assert await client.datasets(tenant) == [record_]

    again = await client.push_dataset(tenant, reach, "reach")
    assert again.report.uploaded == [] and len(again.report.skipped) == len(files)


async def test_a_corrupted_object_is_caught_by_its_digest_naming_the_file(
    client: Client, reach: Path
) -> None:
    tenant = uid("acme")
    victim = next(f.path for f in scan(reach) if f.path.endswith(".parquet"))
    await push_dataset(client.js, tenant, reach, "reach")  # files and manifest, not added
    store = await tenant_store(client.js, tenant, create=False)
    data = (reach / victim).read_bytes()
    await store.put(prefix_of("reach") + victim, data[: len(data) // 2])  # torn in the bucket
    with pytest.raises(RequestError, match=rf"{victim}: sha256 .* does not match the manifest"):
        await client.request(tenant, AddDataset(tenant, "reach"))
    assert await client.datasets(tenant) == [], "nothing recorded for a bad dataset"

    # Pushing again replaces exactly the bad object, and then the dataset is added.
    repaired = await client.push_dataset(tenant, reach, "reach")
    assert repaired.report.uploaded == [victim]
    assert repaired.record.files == len(scan(reach))


@pytest.mark.timeout(400)
async def test_pushed_dataset_trains_and_only_its_tenant_can_name_it_or_its_policies(
    nats_server: EmbeddedServer,
    js: JetStreamContext,
    reach: Path,
    procs: Procs,
    tmp_path: Path,
) -> None:
    start_stack(nats_server.url, tmp_path / "logs", procs)
    alice, bob = uid("alice"), uid("bob")
    async with await Client.connect(nats_server.url) as client:
        pushed = await client.push_dataset(alice, reach, "reach")
        assert pushed.record.source == "pushed"
        job = await client.train_sft(sft_spec(alice, "reach", OFT_2D, 6, checkpoint_every=3))
        result = await job.wait(300)
        assert result.status == "succeeded" and result.policy_version > 1

        # The exported policy is the committed checkpoint, byte for byte.
        exported = await client.export_policy(alice, job.job_id, out_dir=tmp_path / "out")
        rec, _ = await final_policy(js, alice, job.job_id)
        buf = io.BytesIO()
        await (await js.object_store(subjects.OBJ_CHECKPOINTS)).get(rec.object_name, writeinto=buf)
        assert exported.read_bytes() == buf.getvalue()
        assert hashlib.sha256(exported.read_bytes()).hexdigest() == rec.sha256
        assert exported.name == f"{job.job_id}-v{rec.version}.ckpt"
        with pytest.raises(RequestError, match="is newer than"):
            await client.export_policy(alice, job.job_id, rec.version + 1, tmp_path / "out")

        # Bob names alice's dataset id: not in his namespace.
        stolen = await client.train_sft(sft_spec(bob, "reach", OFT_2D, 2))
        with pytest.raises(JobFailed, match=rf"dataset 'reach' is not in tenant {bob}'s namespace"):
            await stolen.wait(60)
        # Bob starts from alice's job, or exports it: only his own jobs exist for him.
        await register_path(js, bob, "mine", reach)
        start = await client.train_sft(sft_spec(bob, "mine", OFT_2D, 2, init_from=job.job_id))
        with pytest.raises(JobFailed, match=rf"init_from: job '{job.job_id}' has no committed"):
            await start.wait(60)
        with pytest.raises(RequestError, match="no committed policy") as export:
            await client.export_policy(bob, job.job_id, out_dir=tmp_path / "bob")
        assert export.value.code == "not_found"
        # A path, sent past the SDK's own check, is refused by the master.
        spec = sft_spec(bob, "mine", OFT_2D, 2)
        spec["dataset"] = str(reach)
        await js.publish(
            subjects.job(bob, "submit"),
            encode(JobSubmit(bob, "raw-path", json.dumps(spec).encode(), 0.0)),
            headers={headers.JOB_ID: "raw-path"},
        )
        with pytest.raises(JobFailed, match="is not a dataset id \\(paths are not accepted\\)"):
            await Job(client, bob, "raw-path").wait(60)


async def test_a_push_past_the_tenants_storage_limit_is_refused_naming_the_file(
    client: Client, reach: Path
) -> None:
    tenant = uid("small")
    # What `joynexus tenant add --max-storage` creates: the bucket's max_bytes is the limit.
    await client.js.create_object_store(bucket=subjects.tenant_bucket(tenant), max_bytes=4096)
    with pytest.raises(DatasetStoreError, match=r"refused it: .*storage limit") as full:
        await client.push_dataset(tenant, reach, "reach")
    assert any(f.path in str(full.value) for f in scan(reach))
    assert await client.datasets(tenant) == [], "nothing recorded"
