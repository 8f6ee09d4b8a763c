"""Datasets live in tenants' namespaces: pushed through the master into the tenant's bucket
(in parts, resumable, verified by digest) or registered by the operator, and named by id in
specs. A path, an unknown id or another tenant's id is refused; a job starts only from its
own tenant's policies; an exported policy is the checkpoint's bytes, read back in parts."""

from __future__ import annotations

import base64
import fcntl
import hashlib
import io
import json
import os
import shutil
import threading
import time
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus import records
from bus.checkpoints import digest
from bus.codec import encode
from bus.datacache import DatasetCache
from bus.datasets import (
    MANIFEST,
    download,
    encode_manifest,
    materialise,
    prefix_of,
    register_path,
    scan,
    sha256_file,
    tenant_store,
)
from bus.kv import list_objects
from bus.records import RevisionConflict, get_policy, put_policy
from bus.server import EmbeddedServer
from clients.push import Ask, push_dataset
from clients.sdk import Client, Job, JobFailed, RequestError
from schemas import headers, subjects
from schemas.jobs import JobRecord, JobStatus, JobSubmit, job_key
from schemas.model import HeadConfig, OptimizerConfig
from schemas.tenantctl import (
    PART_BYTES,
    AddDataset,
    ExportBytes,
    ExportPolicy,
    PartStored,
    PlanDataset,
    PutDatasetPart,
    ReadEvents,
    ReadExport,
    RemoveExport,
    TenantReply,
    TenantRequest,
)
from schemas.tenants import DatasetManifest, ManifestFile
from schemas.train import OpenSlot, PolicyRecord
from services.envs.datasets import record
from services.envs.jobstate import job_ended
from services.envs.sims import REACH2D_ID
from services.master.transfer import uploads_prefix
from tests.conftest import Procs
from tests.helpers import dead_letters, eventually, uid
from tests.sft_helpers import OFT_2D, final_policy, sft_spec, start_stack


class Interrupt(Exception):
    """Stops a push half-way, as a dropped connection or Ctrl-C would."""


@pytest.fixture(scope="module")
def reach(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("datasets") / "reach"
    record(REACH2D_ID, 12, path, seed=0)
    return path


@pytest.fixture(scope="module")
def reach_big(tmp_path_factory: pytest.TempPathFactory, reach: Path) -> Path:
    """The reach dataset and one file of several parts (a push can stop inside it)."""
    path = tmp_path_factory.mktemp("datasets") / "reach-big"
    shutil.copytree(reach, path)
    (path / "extra").mkdir()
    (path / "extra" / "blob.bin").write_bytes(os.urandom(3 * PART_BYTES + 17))
    return path


def asker(client: Client, tenant: str, *, stop_after: int | None = None) -> Ask:
    """What the SDK's push asks through; with ``stop_after``, the push is interrupted (as a
    dropped connection would) at the first part request sent once that many part requests
    have been answered. Parts go several at a time, so counting answers, not sends, keeps
    the parts already sent from being cancelled before the master stores them."""
    answered: list[TenantRequest] = []

    async def ask(request: TenantRequest, timeout: float) -> TenantReply:
        if stop_after is None or not isinstance(request, PutDatasetPart):
            return await client.request(tenant, request, timeout=timeout)
        if len(answered) >= stop_after:
            raise Interrupt
        reply = await client.request(tenant, request, timeout=timeout)
        answered.append(request)
        return reply

    return ask


async def objects(client: Client, tenant: str, prefix: str) -> list[str]:
    """Names of the live objects under ``prefix`` in the tenant's bucket."""
    store = await tenant_store(client.js, tenant, create=False)
    try:
        infos = await store.list(ignore_deletes=True)
    except NotFoundError:
        return []
    return sorted(i.name for i in infos if i.name and i.name.startswith(prefix))


@pytest.fixture
def client(stack: tuple[NATS, Client]) -> Client:
    """A client and the master's responders (in process) on a server of this test alone."""
    return stack[1]


async def test_an_interrupted_push_resumes_uploading_only_the_rest(
    client: Client, reach: Path, tmp_path: Path
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
    # The same files pushed again are the same dataset: one manifest, one copy on disk
    # (the stack's master materialises under tmp_path / "cache").
    assert again.record.digest == record_.digest
    copies = [p for p in (tmp_path / "cache" / tenant / "reach").iterdir()]
    assert [p.name for p in copies] == [record_.digest[:16]]


async def test_a_corrupted_object_is_caught_by_its_digest_naming_the_file(
    client: Client, reach: Path
) -> None:
    tenant = uid("acme")
    victim = next(f.path for f in scan(reach) if f.path.endswith(".parquet"))
    report = await push_dataset(asker(client, tenant), tenant, reach, "reach")  # not added
    store = await tenant_store(client.js, tenant, create=False)
    data = (reach / victim).read_bytes()
    await store.put(prefix_of("reach") + victim, data[: len(data) // 2])  # torn in the bucket
    # The end of a push: the master checks every stored object before it writes a manifest.
    with pytest.raises(RequestError, match=rf"{victim}: the stored object .* is not the pushed"):
        await client.request(tenant, AddDataset(tenant, "reach", report.files))
    assert await objects(client, tenant, prefix_of("reach") + MANIFEST) == []
    # A manifest already in the bucket (an operator's upload): materialising catches it.
    manifest = DatasetManifest("reach", report.files)
    await store.put(prefix_of("reach") + MANIFEST, encode_manifest(manifest))
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

        # Alice removes her job: its versions, their exported copy, its events and its
        # record go; bob cannot remove it.
        with pytest.raises(RequestError, match=f"no job '{job.job_id}' of tenant {bob}"):
            await client.remove_job(bob, job.job_id)
        checkpoints = await js.object_store(subjects.OBJ_CHECKPOINTS)
        versions = await list_objects(checkpoints, f"{alice}/{job.job_id}/")
        assert len(versions) >= 2, "versions kept (checkpoint_every 3, keep 3)"
        removed = await client.remove_job(alice, job.job_id)
        assert removed.jobs == [job.job_id] and removed.objects == len(versions) + 1
        assert removed.events >= 4  # accepted, running, progress..., succeeded
        assert await list_objects(checkpoints, f"{alice}/{job.job_id}/") == []
        assert await client.status(alice, job.job_id) is None
        assert (await client.read_events(ReadEvents(alice, job.job_id, 0))).events == []
        policies = await js.key_value(subjects.KV_POLICIES)
        assert (await get_policy(policies, alice, job.job_id))[0] is None

        # Its id stays removed on every path: a submit that reaches the master's JOBS
        # consumer (replayed, or an operator's) is refused naming it, and an OpenSlot left
        # on TRAIN opens no slot and commits nothing.
        replay = JobSubmit(
            alice, job.job_id, json.dumps(sft_spec(alice, "reach", OFT_2D, 2)).encode(), 0.0
        )
        await js.publish(
            subjects.job(alice, "submit"), encode(replay), headers={headers.JOB_ID: job.job_id}
        )
        with pytest.raises(JobFailed, match="was removed: submit under a new id"):
            await Job(client, alice, job.job_id).wait(60)
        await js.publish(
            subjects.train("tiny", alice), encode(rec.slot), headers={headers.JOB_ID: job.job_id}
        )
        await js._nc.publish(subjects.train_wake("tiny"), b"")
        durable = subjects.trainer_durable("tiny", alice)

        async def settled() -> bool:
            info = await js.consumer_info(subjects.STREAM_TRAIN, durable)
            return info.num_pending == 0 and info.num_ack_pending == 0

        await eventually(settled, timeout=30, what="the left OpenSlot settled")
        assert (await get_policy(policies, alice, job.job_id))[0] is None
        assert await list_objects(checkpoints, f"{alice}/{job.job_id}/") == []
        assert await dead_letters(js, subjects.STREAM_TRAIN, alice) == []


def entry_bytes(entry: Path) -> int:
    return sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())


def used_ago(entry: Path, seconds: float) -> None:
    """Set when ``entry`` was last used (its manifest's mtime) ``seconds`` back."""
    then = time.time() - seconds
    os.utime(entry / MANIFEST, (then, then))


async def test_the_dataset_cache_keeps_to_its_budget_removing_the_least_recently_used_idle(
    client: Client, reach: Path, tmp_path: Path
) -> None:
    """A materialised dataset pushed again, or no longer used, does not stay on disk for
    good: past the cache's budget the least recently used entry idle for min_idle_s is
    removed after a download; one used recently is kept; a removed one is downloaded again
    when named; download directories left by a stopped process go after a day."""
    tenant = uid("acme")
    await client.push_dataset(tenant, reach, "reach")
    size = entry_bytes(reach)
    cache = DatasetCache(tmp_path / "host", max_bytes=int(size * 1.5), min_idle_s=600)
    old, _, old_digest = await materialise(client.js, tenant, "reach", cache)

    changed = tmp_path / "reach-v2"
    shutil.copytree(reach, changed)
    (changed / "extra").mkdir()
    (changed / "extra" / "notes.txt").write_text("re-recorded\n")
    await client.push_dataset(tenant, changed, "reach")  # the same id, new content
    new, _, new_digest = await materialise(client.js, tenant, "reach", cache)
    assert new_digest != old_digest and new != old
    assert old.is_dir() and new.is_dir(), "over budget, but the old one was used just now"

    used_ago(old, 7200)
    await client.push_dataset(tenant, reach, "other")
    other, _, _ = await materialise(client.js, tenant, "other", cache)
    assert not old.exists(), "the least recently used, idle: removed after the download"
    assert new.is_dir() and other.is_dir(), "used in the last min_idle_s: kept over budget"
    assert entry_bytes(new) + entry_bytes(other) > cache.max_bytes

    # A later materialise finds an entry and marks it used: it is kept, the idle one goes.
    used_ago(new, 7200)
    used_ago(other, 7200)
    assert (await materialise(client.js, tenant, "reach", cache))[0] == new
    assert cache.evict() == [other]
    # A removed entry is downloaded again when named, byte for byte.
    again, _, _ = await materialise(client.js, tenant, "other", cache)
    assert again == other
    files = scan(reach)
    for f in files:
        assert (again / f.path).read_bytes() == (reach / f.path).read_bytes(), f.path
    # So is one whose files something else cut into (a temp-dir cleaner ages them one by
    # one): a file gone, a file truncated, its manifest gone.
    for cut in ("unlink", "truncate", "manifest"):
        victim = again / (MANIFEST if cut == "manifest" else files[-1].path)
        if cut == "truncate":
            victim.write_bytes(victim.read_bytes()[:10])
        else:
            victim.unlink()
        mended, _, _ = await materialise(client.js, tenant, "other", cache)
        assert mended == again, cut
        for f in files:
            assert (mended / f.path).read_bytes() == (reach / f.path).read_bytes(), (cut, f.path)

    # A stopped download's directory goes after a day (one being written stays); with no
    # budget (0) entries stay whatever their age.
    stale, fresh = other.parent / ".partial-stale", other.parent / ".partial-fresh"
    for partial in (stale, fresh):
        (partial / "data").mkdir(parents=True)
        (partial / "data" / "part.parquet").write_bytes(b"x" * 100)
    day_ago = time.time() - 2 * 86400
    for path in (stale, stale / "data", stale / "data" / "part.parquet"):
        os.utime(path, (day_ago, day_ago))
    used_ago(new, 7200)
    used_ago(again, 7200)
    unbounded = DatasetCache(cache.root, max_bytes=0, min_idle_s=600)
    assert unbounded.evict() == [stale]
    assert fresh.is_dir() and new.is_dir() and again.is_dir()


def test_only_the_two_most_recently_used_copies_of_a_dataset_id_are_kept(tmp_path: Path) -> None:
    """Found by an audit: a tenant pushing two file sets in turn under one id (its storage
    charged nothing more) made the master one full copy per push, each kept for an hour by
    the idle rule, whatever the cache's budget. Now a new copy leaves at most one other of
    its id, however recently used; other ids and tenants are not touched."""
    cache = DatasetCache(tmp_path / "host", max_bytes=0, min_idle_s=600)

    def copy_of(tenant: str, dataset: str, digest: str, ago: float) -> Path:
        entry = cache.entry(tenant, dataset, digest * 32)
        entry.mkdir(parents=True)
        (entry / MANIFEST).write_bytes(b"{}")
        used_ago(entry, ago)
        return entry

    copies = [copy_of("acme", "reach", f"{i:02d}", ago) for i, ago in enumerate((40, 30, 5, 20))]
    others = [copy_of("acme", "other", "aa", 50), copy_of("bob", "reach", "bb", 50)]
    newest = copy_of("acme", "reach", "ff", 0)
    assert sorted(cache.prune_versions(newest)) == sorted([copies[0], copies[1], copies[3]])
    assert newest.is_dir() and copies[2].is_dir()  # the one used 5 s ago stays beside it
    assert all(o.is_dir() for o in others)
    assert cache.prune_versions(newest) == []


def test_an_eviction_under_way_holds_back_a_use_of_the_cache_until_it_is_done(
    tmp_path: Path,
) -> None:
    """Processes sharing a cache root take its lock: an eviction choosing and moving what
    goes holds it exclusively (here another open file of the lock stands for another
    process's eviction), so a use waits, and then finds the entry or finds it gone; never
    an entry removed after it was found."""
    cache = DatasetCache(tmp_path / "host", max_bytes=1, min_idle_s=600)
    entry = cache.entry("acme", "reach", "ab" * 32)
    entry.mkdir(parents=True)
    (entry / MANIFEST).write_bytes(b"{}")
    used_ago(entry, 7200)
    found: list[bool] = []
    with open(cache.root / ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        user = threading.Thread(target=lambda: found.append(cache.use(entry, {})))
        user.start()
        user.join(timeout=0.5)
        assert user.is_alive() and not found, "a use went on during an eviction"
        fcntl.flock(lock, fcntl.LOCK_UN)
    user.join(timeout=10)
    assert found == [True]
    assert cache.evict() == [], "used just now: kept though over budget"
    used_ago(entry, 7200)
    assert cache.evict() == [entry] and cache.use(entry, {}) is False


async def test_a_removed_dataset_leaves_the_namespace_with_its_files_unless_a_live_job_names_it(
    client: Client, reach: Path, reach_big: Path
) -> None:
    tenant = uid("acme")
    pushed = await client.push_dataset(tenant, reach, "reach")
    # Jobs that have not ended name it: an SFT job, and a pipeline in one of its stages.
    jobs = await client.js.key_value(subjects.KV_JOBS)
    now = time.time()
    users = {
        "sft-1": {"kind": "sft", "tenant": tenant, "dataset": "reach"},
        "pipe-1": {"kind": "pipeline", "stages": [{"kind": "eval", "dataset": "reach"}]},
        "other": {"kind": "sft", "tenant": tenant, "dataset": "not-this-one"},
        # An env's keyword argument of that name is no dataset of the namespace.
        "rl-1": {"kind": "rl", "env": "JoyNexus/Reach2D-v0", "env_kwargs": {"dataset": "reach"}},
    }

    async def put_job(job_id: str, status: JobStatus) -> None:
        spec = json.dumps(users[job_id]).encode()
        record = JobRecord(tenant, job_id, "sft", status, spec, now, now)
        await jobs.put(job_key(tenant, job_id), encode(record))

    for job_id in users:
        await put_job(job_id, "running" if job_id != "pipe-1" else "queued")
    with pytest.raises(RequestError, match="not ended: pipe-1, sft-1; cancel them") as busy:
        await client.remove_dataset(tenant, "reach")
    assert busy.value.code == "invalid" and not busy.value.retryable
    assert await client.datasets(tenant) == [pushed.record], "nothing removed"

    await put_job("sft-1", "succeeded")
    await put_job("pipe-1", "cancelled")
    removed = await client.remove_dataset(tenant, "reach")
    files = scan(reach)
    assert removed.recorded and removed.files == len(files) + 1  # and the manifest
    assert removed.bytes > sum(f.size for f in files)
    assert await client.datasets(tenant) == []
    assert await objects(client, tenant, prefix_of("reach")) == []
    with pytest.raises(RequestError, match="no dataset 'reach' of tenant") as gone:
        await client.remove_dataset(tenant, "reach")
    assert gone.value.code == "not_found"
    # Pushed again, every file is uploaded again and it is back.
    again = await client.push_dataset(tenant, reach, "reach")
    assert again.report.skipped == [] and again.record.files == pushed.record.files

    # A push that stopped inside a file (never added) left a file and parts: they go.
    with pytest.raises(Interrupt):
        await push_dataset(asker(client, tenant, stop_after=3), tenant, reach_big, "big")
    assert await objects(client, tenant, prefix_of("big")), "a file left by the push"
    assert await objects(client, tenant, uploads_prefix("big")), "parts left by the push"
    left = await client.remove_dataset(tenant, "big")
    assert not left.recorded and left.files > 0
    assert await objects(client, tenant, prefix_of("big")) == []
    assert await objects(client, tenant, uploads_prefix("big")) == []

    # A registered dataset: its name leaves the namespace, the operator's directory stays.
    await register_path(client.js, tenant, "mine", reach)
    mine = await client.remove_dataset(tenant, "mine")
    assert (mine.recorded, mine.files) == (True, 0)
    assert [r.dataset for r in await client.datasets(tenant)] == ["reach"]
    assert scan(reach) == files


async def test_a_push_past_the_tenants_storage_limit_is_refused_naming_the_file(
    client: Client, reach: Path
) -> None:
    tenant = uid("small")
    # What `joynexus tenant add --max-storage` creates: the bucket's max_bytes is the limit.
    await client.js.create_object_store(bucket=subjects.tenant_bucket(tenant), max_bytes=4096)
    with pytest.raises(RequestError, match=r"refused it: .*storage limit .*max_bytes") as full:
        await client.push_dataset(tenant, reach, "reach")
    assert full.value.code == "invalid" and not full.value.retryable
    assert any(str(full.value).startswith(f"{f.path}: ") for f in scan(reach)), full.value
    assert await client.datasets(tenant) == [], "nothing recorded"


async def test_a_push_stopped_inside_a_file_resumes_with_only_the_files_not_stored(
    client: Client, reach_big: Path
) -> None:
    tenant = uid("acme")
    files = scan(reach_big)
    first, blob = files[0].path, "extra/blob.bin"
    assert [f.path for f in files[:2]] == [first, blob], "the big file is pushed second"
    # Stopped at the big file's last part (its three others answered): the file is not stored.
    with pytest.raises(Interrupt):
        await push_dataset(asker(client, tenant, stop_after=3), tenant, reach_big, "reach")
    assert await objects(client, tenant, prefix_of("reach")) == [prefix_of("reach") + first]
    assert len(await objects(client, tenant, uploads_prefix("reach"))) == 3, "its parts"

    pushed = await client.push_dataset(tenant, reach_big, "reach")
    assert pushed.report.skipped == [first]
    assert pushed.report.uploaded == [f.path for f in files[1:]]
    assert pushed.report.bytes_uploaded == sum(f.size for f in files[1:])
    assert pushed.record.files == len(files)
    assert pushed.report.manifest_sha256 == pushed.record.digest
    assert await objects(client, tenant, "uploads/") == [], "no part outlives its push"
    # The joined file is the pushed file, byte for byte.
    buf = io.BytesIO()
    await download(client.js, subjects.tenant_bucket(tenant), prefix_of("reach") + blob, buf)
    assert buf.getvalue() == (reach_big / blob).read_bytes()


async def test_a_bad_part_or_path_gets_its_own_error_naming_the_file(client: Client) -> None:
    tenant = uid("acme")

    async def refusal(request: TenantRequest) -> str:
        with pytest.raises(RequestError) as refused:
            await client.request(tenant, request)
        assert refused.value.code == "invalid" and not refused.value.retryable
        return str(refused.value)

    sha = "0" * 64
    for bad in ("../escape.bin", "/etc/passwd", "", "a/../../b"):
        message = await refusal(PlanDataset(tenant, "d", [ManifestFile(bad, 1, sha)]))
        assert f"file path {bad!r} leaves the dataset" in message
        one = PutDatasetPart(tenant, "d", bad, 0, 1, 1, sha, b"x")
        assert f"file path {bad!r} leaves the dataset" in await refusal(one)
    assert "manifest name" in await refusal(
        PutDatasetPart(tenant, "d", MANIFEST, 0, 1, 1, sha, b"x")
    )
    # A name the bucket could not even carry (its subject would pass the server's 4 KiB
    # control line and cost the master its connection), control characters, a file that is
    # also another's directory.
    for bad, why in (
        ("a/" * 600 + "x", "is longer than 1024 bytes"),
        ("n" * 256, "has a component longer than 255 bytes"),
        ("a\x00b", "contains a control character"),
        ("line\nbreak", "contains a control character"),
    ):
        assert why in await refusal(PlanDataset(tenant, "d", [ManifestFile(bad, 1, sha)]))
        assert why in await refusal(PutDatasetPart(tenant, "d", bad, 0, 1, 1, sha, b"x"))
    clash = [ManifestFile("a", 1, sha), ManifestFile("a/b", 1, sha)]
    assert "a: is a file and also a directory" in await refusal(PlanDataset(tenant, "d", clash))

    oversize = PutDatasetPart(
        tenant, "d", "big.bin", 0, 2, PART_BYTES + 1, sha, b"x" * (PART_BYTES + 1)
    )
    assert f"big.bin: part 0 has {PART_BYTES + 1} bytes, more than" in await refusal(oversize)
    data = os.urandom(PART_BYTES + 10)
    wrong = hashlib.sha256(b"something else").hexdigest()

    def part(index: int, *, parts: int = 2, sha256: str = wrong) -> PutDatasetPart:
        piece = data[index * PART_BYTES : (index + 1) * PART_BYTES]
        return PutDatasetPart(tenant, "d", "f.bin", index, parts, len(data), sha256, piece)

    assert "f.bin: part index 2 is not in 0..1" in await refusal(part(2))
    assert "f.bin: 3 parts for" in await refusal(part(0, parts=3))
    # The last part before the others: nothing to join.
    assert "f.bin: part 0 of 2 is not stored" in await refusal(part(1))
    assert await client.request(tenant, part(0)) == PartStored("f.bin", 0, complete=False)
    message = await refusal(part(1))
    assert message.startswith("f.bin: sha256 ") and "does not match the pushed file's" in message
    assert await objects(client, tenant, "") == [], "neither the parts nor the file are kept"

    right = hashlib.sha256(data).hexdigest()
    for index in (0, 1):
        stored = await client.request(tenant, part(index, sha256=right))
        assert stored == PartStored("f.bin", index, complete=index == 1)
    assert await objects(client, tenant, "") == [prefix_of("d") + "f.bin"]


async def _committed_policy(client: Client, tenant: str, job: str, weights: bytes) -> None:
    """A committed policy version 1 of ``job``, as the trainer writes one."""
    name = f"{tenant}/{job}/v000001-{digest(weights)[:16]}"
    await (await client.js.object_store(subjects.OBJ_CHECKPOINTS)).put(name, weights)
    head = HeadConfig("oft", action_dim=2, chunk_len=1, proprio_dim=4)
    slot = OpenSlot(tenant, job, head, OptimizerConfig(), seed=0, total_steps=1)
    policy = PolicyRecord(tenant, job, 1, 1, name, digest(weights), 1, slot, time.time())
    await put_policy(await client.js.key_value(subjects.KV_POLICIES), policy, last=0)


async def test_a_removed_pipeline_takes_its_stages_versions_and_events_and_its_id_is_not_reused(
    client: Client, tmp_path: Path
) -> None:
    tenant, other = uid("acme"), uid("other")
    jobs = await client.js.key_value(subjects.KV_JOBS)
    now = time.time()

    async def put_job(
        job_id: str, status: JobStatus, spec: dict[str, object], parent: str = ""
    ) -> None:
        record = JobRecord(tenant, job_id, "sft", status, json.dumps(spec).encode(), now, now)
        record = msgspec.structs.replace(record, parent=parent)
        await jobs.put(job_key(tenant, job_id), encode(record))

    await put_job("pipe", "running", {"kind": "pipeline", "stages": []})
    await put_job("pipe-s0", "succeeded", {"kind": "sft", "dataset": "d"}, parent="pipe")
    await put_job("pipe-s1", "running", {"kind": "eval", "policy_job": "pipe-s0"}, parent="pipe")
    await _committed_policy(client, tenant, "pipe-s0", os.urandom(1000))
    await client.export_policy(tenant, "pipe-s0", out_dir=tmp_path)  # a copy in the bucket
    await client.js.publish(subjects.event(tenant, "pipe-s0", "progress"), b"\x80")

    with pytest.raises(RequestError, match=r"job\(s\) pipe, pipe-s1 have not ended") as live:
        await client.remove_job(tenant, "pipe")
    assert live.value.code == "invalid"
    # A stage that ended, of a pipeline that has not: its next stage starts from it.
    with pytest.raises(RequestError, match="stage of pipeline 'pipe', which has not ended"):
        await client.remove_job(tenant, "pipe-s0")
    await put_job("pipe", "failed", {"kind": "pipeline", "stages": []})
    await put_job("pipe-s1", "failed", {"kind": "eval", "policy_job": "pipe-s0"}, parent="pipe")
    # A job that has not ended and starts from a stage keeps the pipeline.
    await put_job("next", "queued", {"kind": "sft", "dataset": "d", "init_from": "pipe-s0"})
    with pytest.raises(RequestError, match=r"needed by job\(s\) that have not ended: next"):
        await client.remove_job(tenant, "pipe")
    await put_job("next", "cancelled", {"kind": "sft", "dataset": "d", "init_from": "pipe-s0"})

    with pytest.raises(RequestError, match=f"no job 'pipe' of tenant {other}") as foreign:
        await client.remove_job(other, "pipe")  # another tenant's namespace: not there
    assert foreign.value.code == "not_found"
    removed = await client.remove_job(tenant, "pipe")
    assert removed.jobs == ["pipe", "pipe-s0", "pipe-s1"]
    assert removed.objects == 2 and removed.bytes == 2000  # the checkpoint and its export
    assert removed.events == 1
    assert [r.job_id for r in await client.jobs(tenant)] == ["next"]
    assert (await get_policy(await client.js.key_value(subjects.KV_POLICIES), tenant, "pipe-s0"))[
        0
    ] is None
    checkpoints = await client.js.object_store(subjects.OBJ_CHECKPOINTS)
    assert await list_objects(checkpoints, f"{tenant}/pipe") == []
    assert await objects(client, tenant, "policies/") == []
    with pytest.raises(RequestError, match="no job 'pipe' of tenant") as gone:
        await client.remove_job(tenant, "pipe")
    assert gone.value.code == "not_found"
    # The id is not given to a new job: not by a submit, not by any other writer of its
    # record (the master's own JOBS path, a pipeline's stage); not cancelled either.
    with pytest.raises(RequestError, match=r"'pipe-s0' was a job of tenant .* that was removed"):
        await client.submit(sft_spec(tenant, "d", OFT_2D, 2), job_id="pipe-s0")
    fresh = JobRecord(tenant, "pipe-s0", "sft", "accepted", b"{}", now, now)
    with pytest.raises(RevisionConflict):
        await records.put_job(jobs, fresh, last=0)
    with pytest.raises(RequestError, match=r"'pipe' of tenant .* was removed") as cancel:
        await client.cancel(tenant, "pipe")
    assert cancel.value.code == "not_found"
    # An env worker's task of the removed job is a task of a job that ended.
    assert await job_ended(client.js, tenant, "pipe-s0")
    assert not await job_ended(client.js, tenant, "never-submitted")


async def test_an_export_is_read_back_in_parts_and_matches_the_checkpoint(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant, job = uid("acme"), "j1"
    weights = os.urandom(2 * PART_BYTES + 100)
    await _committed_policy(client, tenant, job, weights)
    reads: list[ReadExport] = []
    request = client.request

    async def counting(tenant_: str, req: TenantRequest, *, timeout: float = 10.0) -> TenantReply:
        if isinstance(req, ReadExport):
            reads.append(req)
        return await request(tenant_, req, timeout=timeout)

    monkeypatch.setattr(client, "request", counting)
    exported = await client.export_policy(tenant, job, out_dir=tmp_path / "out")
    assert exported == tmp_path / "out" / f"{job}-v1.ckpt"
    assert exported.read_bytes() == weights and sha256_file(exported) == digest(weights)
    assert [r.offset for r in reads] == [0, PART_BYTES, 2 * PART_BYTES]
    assert list((tmp_path / "out").iterdir()) == [exported], "no .partial left"
    monkeypatch.undo()

    name = f"policies/{job}/v1"
    whole = await client.request(tenant, ReadExport(tenant, name, 0))  # length 0: a part
    assert isinstance(whole, ExportBytes) and whole.data == weights[:PART_BYTES]
    tail = await client.request(tenant, ReadExport(tenant, name, len(weights) - 5, 1 << 30))
    assert isinstance(tail, ExportBytes) and tail.data == weights[-5:]
    assert tail.size == len(weights)
    for bad, says in [
        (ReadExport(tenant, name, len(weights) + 1), "is past the end"),
        (ReadExport(tenant, name, -1), "is negative"),
        (ReadExport(tenant, prefix_of("d") + MANIFEST, 0), "is not an exported policy"),
        (ReadExport(tenant, "policies/../x/v1", 0), "is not an exported policy"),
        (ReadExport(tenant, "policies/a..b/v1", 0), "job id"),
    ]:
        with pytest.raises(RequestError, match=says) as refused:
            await client.request(tenant, bad)
        assert refused.value.code == "invalid", bad
    with pytest.raises(RequestError, match="no exported policy policies/j2/v1") as missing:
        await client.request(tenant, ReadExport(tenant, "policies/j2/v1", 0))
    assert missing.value.code == "not_found"


async def test_an_exported_copy_leaves_the_tenants_bucket_and_the_committed_versions_stay(
    client: Client, tmp_path: Path
) -> None:
    """Every export keeps a copy in the tenant's bucket, which is its storage limit: a
    tenant could give that storage back only by removing the whole job."""
    tenant, other, job = uid("acme"), uid("other"), "j1"
    first, second = os.urandom(3000), os.urandom(5000)
    await _committed_policy(client, tenant, job, first)
    kv = await client.js.key_value(subjects.KV_POLICIES)
    record, revision = await get_policy(kv, tenant, job)
    assert record is not None
    name = f"{tenant}/{job}/v000002-{digest(second)[:16]}"
    await (await client.js.object_store(subjects.OBJ_CHECKPOINTS)).put(name, second)
    later = msgspec.structs.replace(record, version=2, object_name=name, sha256=digest(second))
    await put_policy(kv, later, last=revision)
    for version in (1, 2):
        await client.export_policy(tenant, job, version=version, out_dir=tmp_path)
    assert await objects(client, tenant, "policies/") == [
        f"policies/{job}/v1",
        f"policies/{job}/v2",
    ]

    removed = await client.remove_export(tenant, job, version=1)
    assert (removed.job_id, removed.versions, removed.bytes) == (job, [1], len(first))
    assert await objects(client, tenant, "policies/") == [f"policies/{job}/v2"]
    for bad, code, says in [
        (RemoveExport(tenant, job, 1), "not_found", "no exported copy of version 1 of job 'j1'"),
        (RemoveExport(tenant, job, -1), "invalid", "version: -1 is negative"),
        (RemoveExport(tenant, "a..b"), "invalid", "job id"),
        (RemoveExport(other, job), "not_found", "no exported copy of any version"),
    ]:
        with pytest.raises(RequestError, match=says) as refused:
            await client.request(bad.tenant, bad)
        assert refused.value.code == code, bad
    everything = await client.remove_export(tenant, job)
    assert (everything.versions, everything.bytes) == ([2], len(second))
    assert await objects(client, tenant, "policies/") == []
    with pytest.raises(RequestError, match="no exported copy of any version") as gone:
        await client.remove_export(tenant, job)
    assert gone.value.code == "not_found"
    # Only the copies went: the committed versions export again.
    again = await client.export_policy(tenant, job, version=1, out_dir=tmp_path / "again")
    assert again.read_bytes() == first


async def test_an_older_versions_export_is_the_object_its_commit_recorded_not_an_orphan(
    client: Client, tmp_path: Path
) -> None:
    """A commit that wrote its object and then lost its record leaves a second object of
    that version, never committed: the export of that version is the committed one."""
    tenant, job = uid("acme"), "j1"
    store = await client.js.object_store(subjects.OBJ_CHECKPOINTS)

    def listed_at(data: bytes) -> str:  # the server lists objects by their meta subject
        name = f"{tenant}/{job}/v000001-{digest(data)[:16]}"
        return base64.urlsafe_b64encode(name.encode()).decode()

    committed = os.urandom(1000)
    orphan = os.urandom(1000)
    while listed_at(orphan) > listed_at(committed):
        orphan = os.urandom(1000)
    await store.put(f"{tenant}/{job}/v000001-{digest(orphan)[:16]}", orphan)
    await _committed_policy(client, tenant, job, committed)
    kv = await client.js.key_value(subjects.KV_POLICIES)
    first, revision = await get_policy(kv, tenant, job)
    assert first is not None
    later = os.urandom(1000)
    name = f"{tenant}/{job}/v000002-{digest(later)[:16]}"
    await store.put(name, later)
    second = msgspec.structs.replace(first, version=2, object_name=name, sha256=digest(later))
    await put_policy(kv, second, last=revision)
    exported = await client.export_policy(tenant, job, version=1, out_dir=tmp_path)
    assert exported.read_bytes() == committed


async def test_an_export_past_the_tenants_storage_limit_is_refused_naming_the_limit(
    client: Client, tmp_path: Path
) -> None:
    """It was answered 'unavailable: the bus did not answer' (retryable), which no retry
    mends."""
    tenant, job = uid("small"), "j1"
    await client.js.create_object_store(bucket=subjects.tenant_bucket(tenant), max_bytes=4096)
    await _committed_policy(client, tenant, job, os.urandom(3 * 4096))
    with pytest.raises(RequestError, match=r"policies/j1/v1: .*refused it: .*storage limit"):
        await client.export_policy(tenant, job, out_dir=tmp_path)
    with pytest.raises(RequestError) as full:
        await client.request(tenant, ExportPolicy(tenant, job))
    assert full.value.code == "invalid" and not full.value.retryable
