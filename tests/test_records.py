"""bus.records against a real nats-server: typed reads, compare-and-set that loses to a
concurrent writer, create-after-delete, watch entries, and job listing."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from bus.codec import DecodeError
from bus.errors import RetryableError
from bus.records import (
    RevisionConflict,
    get_job,
    get_policy,
    job_of,
    list_jobs,
    policy_of,
    put_job,
    put_policy,
)
from schemas import subjects
from schemas.jobs import JobRecord, JobStatus, job_key
from schemas.model import HeadConfig, OptimizerConfig
from schemas.train import OpenSlot, PolicyRecord
from tests.helpers import uid


def policy(tenant: str, job_id: str, version: int) -> PolicyRecord:
    spec = OpenSlot(tenant, job_id, HeadConfig(kind="oft", action_dim=2), OptimizerConfig(), 0, 5)
    name = f"{tenant}/{job_id}/v{version:06d}-0123456789abcdef"
    return PolicyRecord(tenant, job_id, version, version * 10, name, "ab" * 32, 7, spec, 1.0)


def job(tenant: str, job_id: str, status: JobStatus = "accepted", at: float = 1.0) -> JobRecord:
    return JobRecord(tenant, job_id, "sft", status, b"{}", at, at)


async def policies_kv(js: JetStreamContext) -> KeyValue:
    return await js.key_value(subjects.KV_POLICIES)


async def test_a_job_with_nothing_committed_reads_as_none_at_revision_zero(
    js: JetStreamContext,
) -> None:
    kv = await policies_kv(js)
    assert await get_policy(kv, uid("tenant"), "job") == (None, 0)
    assert await get_job(await js.key_value(subjects.KV_JOBS), uid("tenant"), "job") == (None, 0)


async def test_create_then_compare_and_set_round_trips_the_typed_record(
    js: JetStreamContext,
) -> None:
    kv = await policies_kv(js)
    tenant = uid("tenant")
    first = policy(tenant, "job", 1)
    rev1 = await put_policy(kv, first, last=0)
    assert await get_policy(kv, tenant, "job") == (first, rev1)
    second = msgspec.structs.replace(first, version=2, batches_done=3)
    rev2 = await put_policy(kv, second, last=rev1)
    assert rev2 > rev1
    assert await get_policy(kv, tenant, "job") == (second, rev2)
    assert (await kv.get(job_key(tenant, "job"))).revision == rev2  # the key layout


async def test_a_stale_revision_or_a_second_create_is_a_conflict_and_changes_nothing(
    js: JetStreamContext,
) -> None:
    kv = await policies_kv(js)
    tenant = uid("tenant")
    rev1 = await put_policy(kv, policy(tenant, "job", 1), last=0)
    rev2 = await put_policy(kv, policy(tenant, "job", 2), last=rev1)
    with pytest.raises(RevisionConflict) as stale:
        await put_policy(kv, policy(tenant, "job", 9), last=rev1)
    assert stale.value.last == rev1 and stale.value.key == f"{tenant}.job"
    assert isinstance(stale.value, RetryableError)
    with pytest.raises(RevisionConflict):
        await put_policy(kv, policy(tenant, "job", 9), last=0)
    record, revision = await get_policy(kv, tenant, "job")
    assert (record.version if record else None, revision) == (2, rev2)


async def test_of_two_writers_from_one_revision_exactly_one_wins(js: JetStreamContext) -> None:
    kv = await js.key_value(subjects.KV_JOBS)
    tenant = uid("tenant")
    rev = await put_job(kv, job(tenant, "j"), last=0)
    results = await asyncio.gather(
        put_job(kv, job(tenant, "j", "running"), last=rev),
        put_job(kv, job(tenant, "j", "cancelled"), last=rev),
        return_exceptions=True,
    )
    wins = [r for r in results if isinstance(r, int)]
    losses = [r for r in results if isinstance(r, RevisionConflict)]
    assert len(wins) == 1 and len(losses) == 1, results
    record, revision = await get_job(kv, tenant, "j")
    assert record is not None and revision == wins[0]
    assert record.status == ("running" if results[0] is wins[0] else "cancelled")


async def test_a_deleted_record_reads_as_none_and_can_be_created_again(
    js: JetStreamContext,
) -> None:
    kv = await policies_kv(js)
    tenant = uid("tenant")
    await put_policy(kv, policy(tenant, "job", 1), last=0)
    await kv.delete(job_key(tenant, "job"))
    assert await get_policy(kv, tenant, "job") == (None, 0)
    again = policy(tenant, "job", 1)
    revision = await put_policy(kv, again, last=0)
    assert await get_policy(kv, tenant, "job") == (again, revision)


async def test_an_undecodable_value_is_a_decode_error(js: JetStreamContext) -> None:
    kv = await policies_kv(js)
    tenant = uid("tenant")
    await kv.put(job_key(tenant, "job"), b"\xc1 not msgpack")
    with pytest.raises(DecodeError):
        await get_policy(kv, tenant, "job")
    with pytest.raises(ValueError):
        await put_policy(kv, policy(tenant, "job", 1), last=-1)


async def test_watch_entries_decode_to_records_and_deletions_to_none(
    js: JetStreamContext,
) -> None:
    policies, jobs = await policies_kv(js), await js.key_value(subjects.KV_JOBS)
    tenant = uid("tenant")
    key = job_key(tenant, "job")
    watcher = await policies.watch(key)
    try:
        assert await watcher.updates(timeout=5) is None  # no current value
        record = policy(tenant, "job", 1)
        await put_policy(policies, record, last=0)
        entry = await watcher.updates(timeout=5)
        assert entry is not None and policy_of(entry) == record
        await policies.delete(key)
        entry = await watcher.updates(timeout=5)
        assert entry is not None and entry.operation == "DEL" and policy_of(entry) is None
    finally:
        await watcher.stop()
    await put_job(jobs, job(tenant, "job"), last=0)
    entry = await jobs.get(key)
    assert job_of(entry) == job(tenant, "job")


async def test_list_jobs_returns_one_tenants_live_records_oldest_first(
    js: JetStreamContext,
) -> None:
    kv = await js.key_value(subjects.KV_JOBS)
    tenant, other = uid("tenant"), uid("other")
    now = time.time()
    for job_id, at in (("late", now + 2), ("early", now), ("gone", now + 1)):
        await put_job(kv, job(tenant, job_id, at=at), last=0)
    await put_job(kv, job(other, "x", at=now), last=0)
    await kv.delete(job_key(tenant, "gone"))
    assert [r.job_id for r in await list_jobs(js, tenant)] == ["early", "late"]
    everyone = {(r.tenant, r.job_id) for r in await list_jobs(js)}
    assert {(tenant, "early"), (tenant, "late"), (other, "x")} <= everyone
    assert (tenant, "gone") not in everyone


async def test_a_jobs_record_that_does_not_decode_is_left_out_of_the_list(
    js: JetStreamContext,
) -> None:
    """Found by an audit: one damaged (or newer-schema) record made list_jobs raise, which
    stopped the master at every start, for every tenant. It is its own job's problem."""
    kv = await js.key_value(subjects.KV_JOBS)
    tenant = uid("tenant")
    await put_job(kv, job(tenant, "fine", at=time.time()), last=0)
    await kv.put(job_key(tenant, "damaged"), b"\xff\xfe garbage")
    assert [r.job_id for r in await list_jobs(js, tenant)] == ["fine"]
