"""Tenants' requests to the master (``nexus.ctl.tenant.<tenant>.<op>``, ``nexus.ctl.backbones``)
answered by the master's real responders on a real server, and the SDK's event follower
surviving the loss of its consumer.

Each test has a server of its own: the responders under test must be the only ones in the
``master`` queue group."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.codec import decode, encode
from bus.datasets import register_path, tenant_store
from bus.records import put_job
from bus.server import EmbeddedServer
from clients.sdk import Client, RequestError
from schemas import subjects
from schemas.health import Heartbeat
from schemas.jobs import JobRecord
from schemas.placement import PlacementRecord, placement_key
from schemas.tenantctl import (
    TENANT_REPLY_DECODER,
    AddDataset,
    BackbonesQuery,
    CtlError,
    GetJob,
    JobsReply,
    ListJobs,
)
from schemas.tenants import ManifestFile, TenantRecord
from tests.helpers import uid


async def _job(js: JetStreamContext, tenant: str, job_id: str, at: float) -> JobRecord:
    record = JobRecord(tenant, job_id, "sft", "running", b"{}", at, at)
    await put_job(await js.key_value(subjects.KV_JOBS), record, last=0)
    return record


async def _ask(nc: NATS, subject: str, data: bytes) -> object:
    return decode(TENANT_REPLY_DECODER, (await nc.request(subject, data, timeout=5)).data)


async def test_each_request_answers_with_the_tenants_own_records_only(
    stack: tuple[NATS, Client], tmp_path: Path
) -> None:
    nc, client = stack
    js = nc.jetstream()
    alice, bob = uid("alice"), uid("bob")
    first = await _job(js, alice, "j1", 1.0)
    second = await _job(js, alice, "j2", 2.0)
    await _job(js, bob, "j1", 3.0)

    assert await client.status(alice, "j1") == first
    assert await client.status(alice, "nope") is None, "an unknown job is None, not an error"
    with pytest.raises(RequestError, match=f"no job 'nope' of tenant {alice}") as unknown:
        await client.request(alice, GetJob(alice, "nope"))
    assert unknown.value.code == "not_found" and not unknown.value.retryable
    assert await client.jobs(alice) == [first, second]
    assert [r.tenant for r in await client.jobs(bob)] == [bob]

    (tmp_path / "d").mkdir()
    registered = await register_path(js, alice, "reach", tmp_path / "d")
    assert await client.datasets(alice) == [registered]
    assert await client.datasets(bob) == []

    with pytest.raises(RequestError, match="no committed policy") as export:
        await client.export_policy(alice, "j1", out_dir=tmp_path / "out")
    assert export.value.code == "not_found"
    with pytest.raises(RequestError, match=f"has no bucket data-{alice}") as add:
        await client.request(alice, AddDataset(alice, "never-pushed"))
    assert add.value.code == "not_found"
    await tenant_store(js, alice, create=True)  # what `joynexus tenant add` creates
    with pytest.raises(RequestError, match="'never-pushed' has no manifest") as add:
        await client.request(alice, AddDataset(alice, "never-pushed"))
    assert add.value.code == "not_found"
    # The end of a push names its files: one that was never stored is named.
    files = [ManifestFile("data.bin", 3, hashlib.sha256(b"abc").hexdigest())]
    with pytest.raises(RequestError, match=r"data\.bin: not stored: push the dataset") as add:
        await client.request(alice, AddDataset(alice, "never-pushed", files))
    assert add.value.code == "invalid"


async def test_a_request_claiming_another_tenant_or_malformed_gets_a_typed_error(
    stack: tuple[NATS, Client],
) -> None:
    nc, _ = stack
    js = nc.jetstream()
    alice, bob = uid("alice"), uid("bob")
    await _job(js, alice, "j1", 1.0)

    # Bob's subject, a request naming alice: refused, and alice's record is not in the reply.
    reply = await _ask(nc, subjects.tenant_ctl(bob, "job"), encode(GetJob(alice, "j1")))
    assert isinstance(reply, CtlError) and reply.code == "tenant_mismatch", reply
    assert alice in reply.message and bob in reply.message and not reply.retryable
    reply = await _ask(nc, subjects.tenant_ctl(bob, "jobs"), encode(ListJobs(alice)))
    assert isinstance(reply, CtlError) and reply.code == "tenant_mismatch"

    for subject, data in [
        (subjects.tenant_ctl(alice, "job"), b"\x00garbage"),
        (subjects.tenant_ctl(alice, "job"), encode(ListJobs(alice))),  # tag is not the op
        (subjects.tenant_ctl(alice, "export"), encode({"tenant": alice})),
    ]:
        reply = await _ask(nc, subject, data)
        assert isinstance(reply, CtlError) and reply.code == "malformed", (subject, reply)
    assert "'jobs' request was sent on the 'job' subject" in str(
        await _ask(nc, subjects.tenant_ctl(alice, "job"), encode(ListJobs(alice)))
    )
    bad = await nc.request(subjects.BACKBONES_QUERY, b"\x01\x02", timeout=5)
    assert b"malformed backbones request" in bad.data


async def test_a_reply_aimed_at_another_tenants_subjects_is_not_sent(
    stack: tuple[NATS, Client],
) -> None:
    """The broker checks what a client publishes to, never the reply subject it names: bob
    may not make the master answer onto alice's events (a stream would store it) or inbox."""
    nc, _ = stack
    js = nc.jetstream()
    alice, bob = uid("alice"), uid("bob")
    await _job(js, bob, "j1", 1.0)
    seen: list[bytes] = []

    async def on_msg(msg: Msg) -> None:
        seen.append(msg.data)

    inbox = f"{subjects.tenant_inbox_prefix(alice)}.stolen"
    await nc.subscribe(inbox, cb=on_msg)
    events = subjects.event(alice, "j1", "state")
    for reply in (events, inbox, subjects.job(alice, "cancel")):
        await nc.publish(subjects.tenant_ctl(bob, "jobs"), encode(ListJobs(bob)), reply=reply)
    await nc.publish(subjects.BACKBONES_QUERY, b"", reply=events)
    # His own inbox is answered, after the others: once it is, they were dropped.
    own = await nc.request(subjects.tenant_ctl(bob, "jobs"), encode(ListJobs(bob)), timeout=5)
    assert isinstance(decode(TENANT_REPLY_DECODER, own.data), JobsReply)
    await nc.flush()
    assert seen == []
    info = await js.stream_info(subjects.STREAM_EVENTS, subjects_filter=events)
    assert not (info.state.subjects or {}).get(events), "nothing stored on alice's events"
    jobs = await js.stream_info(subjects.STREAM_JOBS, subjects_filter=f"nexus.job.{alice}.>")
    assert not jobs.state.subjects, "nothing stored on alice's job subjects"


async def test_registered_tenants_exist_then_an_unregistered_one_is_refused(
    stack: tuple[NATS, Client],
) -> None:
    nc, client = stack
    js = nc.jetstream()
    alice, mallory = uid("alice"), uid("mallory")
    await _job(js, alice, "j1", 1.0)
    assert await client.jobs(mallory) == [], "open mode: every tenant is answered"
    tenants = await js.key_value(subjects.KV_TENANTS)
    await tenants.put(alice, encode(TenantRecord(alice, "UKEY", time.time())))
    # Said with what to do: a tenant is registered by the operator.
    hint = f"unknown tenant '{mallory}': no identity .* joynexus tenant add {mallory}"
    with pytest.raises(RequestError, match=hint) as refused:
        await client.jobs(mallory)
    assert refused.value.code == "unknown_tenant"
    assert [r.job_id for r in await client.jobs(alice)] == ["j1"]
    await tenants.put(alice, encode(TenantRecord(alice, "UKEY", time.time(), revoked=True)))
    with pytest.raises(RequestError, match=f"unknown tenant '{alice}': its identity was revoked"):
        await client.jobs(alice)


async def test_backbones_answers_the_live_placements(stack: tuple[NATS, Client]) -> None:
    nc, client = stack
    js = nc.jetstream()
    assert await client.backbones() == []
    live = PlacementRecord("tiny", "trainer", "t-1", model_type="idefics3", at=time.time())
    dead = PlacementRecord("tiny", "inferencer", "i-gone", at=time.time())
    placement = await js.key_value(subjects.KV_PLACEMENT)
    for record in (live, dead):
        await placement.put(placement_key(record), encode(record))
    # Its host's clock is a minute behind: the bucket's TTL (the server's clock) says it
    # is fresh.
    beat = Heartbeat("trainer", "t-1", 1, "host", time.time(), time.time() - 60.0, "test")
    await (await js.key_value(subjects.KV_HEARTBEATS)).put("trainer.t-1", encode(beat))
    assert await client.backbones() == [live], "only instances that heartbeat"
    reply = await nc.request(subjects.BACKBONES_QUERY, encode(BackbonesQuery()), timeout=5)
    assert b"idefics3" in reply.data


async def test_no_master_is_a_retryable_error_not_a_hang(fresh_server: EmbeddedServer) -> None:
    async with await Client.connect(fresh_server.url) as client:
        started = time.monotonic()
        with pytest.raises(RequestError, match="no master answered") as none:
            await client.request("acme", ListJobs("acme"), timeout=1.0)
        assert none.value.retryable and time.monotonic() - started < 5
