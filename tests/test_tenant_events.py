"""A tenant's job commands and events through the master (tenants have no JetStream):
submits and cancels queued on ``JOBS`` for it, events read a page at a time, and the SDK's
follower returning every event once, in order, across a master restart."""

from __future__ import annotations

import asyncio
import signal
import time
import typing
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.codec import decode, encode
from bus.connect import connect
from bus.datacache import DatasetCache
from bus.declare import declare
from bus.publish import publish_event
from bus.records import put_job
from bus.server import EmbeddedServer
from clients.follow import EventFollower
from clients.jobs import Job
from clients.sdk import Client, RequestError
from schemas import subjects
from schemas.events import EVENT_DECODER, Progress, Rejected, StateChanged
from schemas.jobs import JOB_COMMAND_DECODER, JobCancel, JobRecord, JobSubmit
from schemas.tenantctl import (
    TENANT_REPLY_DECODER,
    CancelJob,
    CtlError,
    DatasetPlan,
    EventsPage,
    JobsReply,
    ListJobs,
    PlanDataset,
    Queued,
    ReadEvents,
    SubmitJob,
    TenantRequest,
)
from schemas.tenants import ManifestFile
from services.master.queries import Queries
from tests.conftest import Procs
from tests.helpers import eventually, start_service, uid


async def progress(js: JetStreamContext, tenant: str, job: str, step: int) -> None:
    event = Progress(tenant, job, step, 10, {"loss": float(step)}, time.time())
    await js.publish(subjects.event(tenant, job, "progress"), encode(event))


def steps(stored: Sequence[object]) -> list[int]:
    return [e.step for e in stored if isinstance(e, Progress)]


async def test_submit_and_cancel_are_queued_on_jobs_once(stack: tuple[NATS, Client]) -> None:
    nc, client = stack
    js = nc.jetstream()
    tenant, job = uid("acme"), uid("j")
    first = await client.request(tenant, SubmitJob(tenant, job, b'{"kind": "sft"}'))
    again = await client.request(tenant, SubmitJob(tenant, job, b'{"kind": "sft"}'))
    assert isinstance(first, Queued) and isinstance(again, Queued)
    assert not first.duplicate and again.duplicate and again.stream_seq == first.stream_seq
    stored = await js.get_msg(subjects.STREAM_JOBS, first.stream_seq)
    assert stored.subject == subjects.job(tenant, "submit")
    command = decode(JOB_COMMAND_DECODER, stored.data or b"")
    assert isinstance(command, JobSubmit) and command.tenant == tenant
    assert command.spec_json == b'{"kind": "sft"}'
    cancel = await client.request(tenant, CancelJob(tenant, job, "enough"))
    assert isinstance(cancel, Queued)
    stored = await js.get_msg(subjects.STREAM_JOBS, cancel.stream_seq)
    command = decode(JOB_COMMAND_DECODER, stored.data or b"")
    assert isinstance(command, JobCancel) and command.reason == "enough"
    with pytest.raises(RequestError, match="job id") as bad:
        await client.request(tenant, SubmitJob(tenant, "no spaces allowed", b"{}"))
    assert bad.value.code == "invalid"


async def test_a_submit_under_a_recorded_jobs_id_with_another_spec_is_refused_at_once(
    stack: tuple[NATS, Client],
) -> None:
    """It was queued; within the duplicate window it was dropped as the first submit (the
    caller then followed the other job), after it the master refused it on the recorded
    job's own event subject (ending that job's followers with ``rejected``)."""
    nc, client = stack
    tenant, job = uid("acme"), "exp1"
    spec = b'{"kind": "sft"}'
    record = JobRecord(tenant, job, "sft", "running", spec, 1.0, 1.0)
    await put_job(await nc.jetstream().key_value(subjects.KV_JOBS), record, last=0)
    with pytest.raises(
        RequestError, match=r"'exp1' is already used by another job .*new id"
    ) as used:
        await client.request(tenant, SubmitJob(tenant, job, b'{"kind": "sft", "seed": 7}'))
    assert used.value.code == "invalid" and not used.value.retryable
    same = await client.request(tenant, SubmitJob(tenant, job, spec))  # the same submit again
    assert isinstance(same, Queued)


async def test_a_submit_again_after_its_rejection_is_refused_naming_it_not_dropped(
    stack: tuple[NATS, Client],
) -> None:
    """A submit the master rejected left no record; sent again (the spec fixed, or what it
    names now there) inside the duplicate window, it was dropped as the same submit and
    answered as queued: it never reached the master, and its follower read the old
    rejection. It is refused naming that rejection; one still queued stays queued."""
    nc, client = stack
    tenant, job = uid("acme"), "exp1"
    spec = b'{"kind": "sft"}'
    first = await client.request(tenant, SubmitJob(tenant, job, spec))
    assert isinstance(first, Queued) and not first.duplicate
    pending = await client.request(tenant, SubmitJob(tenant, job, spec))
    assert isinstance(pending, Queued) and pending.duplicate  # not handled yet: still queued
    # An older rejection of another command under this id is not this submit's.
    older = Rejected(tenant, job, "unknown job", time.time())
    await publish_event(nc.jetstream(), older, first.stream_seq - 1)
    again = await client.request(tenant, SubmitJob(tenant, job, spec))
    assert isinstance(again, Queued) and again.duplicate
    reason = "dataset 'demos' is not in tenant acme's namespace"
    rejected = Rejected(tenant, job, reason, time.time())
    await publish_event(nc.jetstream(), rejected, first.stream_seq)  # what the master does
    with pytest.raises(RequestError, match=f"'exp1' was rejected: {reason}; submit under a new"):
        await client.request(tenant, SubmitJob(tenant, job, b'{"kind": "sft", "seed": 1}'))


async def test_a_tenants_jobs_are_listed_in_pages_past_what_one_reply_holds(
    stack: tuple[NATS, Client],
) -> None:
    """Job records are kept for ever and carry their specs (64 KiB at most): listing them
    in one reply failed for good once they passed the server's max_payload."""
    nc, client = stack
    kv = await nc.jetstream().key_value(subjects.KV_JOBS)
    tenant = uid("acme")
    for i in range(24):
        spec = b'{"kind": "sft", "pad": "' + b"x" * 60_000 + b'"}'
        await put_job(kv, JobRecord(tenant, f"j{i:02d}", "sft", "succeeded", spec, i, i), last=0)
    listed = await client.jobs(tenant)
    assert [r.job_id for r in listed] == [f"j{i:02d}" for i in range(24)]
    first = await client.request(tenant, ListJobs(tenant))
    assert isinstance(first, JobsReply) and 0 < len(first.records) < 24
    assert first.next_after == first.records[-1].job_id
    rest = await client.request(tenant, ListJobs(tenant, first.next_after))
    assert isinstance(rest, JobsReply) and rest.records[0].job_id == f"j{len(first.records):02d}"
    with pytest.raises(RequestError, match="after"):
        await client.request(tenant, ListJobs(tenant, "no spaces"))


async def test_events_are_read_in_pages_of_the_tenants_own_job_only(
    stack: tuple[NATS, Client],
) -> None:
    nc, client = stack
    js = nc.jetstream()
    tenant, other, job = uid("acme"), uid("bob"), uid("j")
    for step in range(1, 301):
        await progress(js, tenant, job, step)
    await progress(js, other, job, 1)  # the same job id under another tenant
    seen: list[object] = []
    after = 0
    for _ in range(10):
        page = await client.read_events(ReadEvents(tenant, job, after, limit=128))
        if not page.events:
            break
        assert len(page.events) <= 128
        seen += [decode(EVENT_DECODER, e.data) for e in page.events]
        after = page.last_seq
    assert steps(seen) == list(range(1, 301))
    assert all(getattr(e, "tenant", tenant) == tenant for e in seen)
    empty = await client.read_events(ReadEvents(tenant, job, after))
    assert empty == EventsPage([], after)
    for bad, field in (
        (ReadEvents(tenant, job, -1), "after_seq"),
        (ReadEvents(tenant, job, 2**64 - 1), r"after_seq: \d+ is not in"),  # not "the bus"
        (ReadEvents(tenant, job, 0, 0), "limit"),
    ):
        with pytest.raises(RequestError, match=field):
            await client.read_events(bad)


async def test_a_live_event_wakes_the_follower_long_before_its_poll(
    stack: tuple[NATS, Client],
) -> None:
    nc, client = stack
    tenant, job = uid("acme"), uid("j")
    follower = EventFollower(client.nc, client.read_events, tenant, job, poll_s=60.0)
    try:
        waiting = asyncio.ensure_future(follower.next(30.0))
        await eventually(lambda: follower.pages >= 1 or None, what="the first (empty) page")
        started = time.monotonic()
        await progress(nc.jetstream(), tenant, job, 7)
        stored = await waiting
        assert steps([decode(EVENT_DECODER, stored.data)]) == [7]
        assert time.monotonic() - started < 10.0  # woken, not the 60 s poll
    finally:
        await follower.close()


@pytest.mark.timeout(120)
async def test_the_follower_returns_every_event_once_across_a_master_restart(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    tenant, job = uid("acme"), uid("j")
    for step in range(1, 4):
        await progress(js, tenant, job, step)
    master = procs.add(start_service("master", fresh_server.url, tmp_path / "m1.log"))
    client = await Client.connect(fresh_server.url)
    follower = EventFollower(client.nc, client.read_events, tenant, job, poll_s=0.3)
    try:
        seen = [decode(EVENT_DECODER, (await follower.next(60)).data) for _ in range(2)]
        master.send_signal(signal.SIGKILL)
        master.wait(10)
        for step in range(4, 7):
            await progress(js, tenant, job, step)
        procs.add(start_service("master", fresh_server.url, tmp_path / "m2.log"))
        seen += [decode(EVENT_DECODER, (await follower.next(60)).data) for _ in range(4)]
        assert steps(seen) == [1, 2, 3, 4, 5, 6]
        with pytest.raises(TimeoutError):
            await follower.next(1.0)
    finally:
        await follower.close()
        await client.close()
        await nc.close()


def test_every_tenant_request_has_its_subject() -> None:
    tags = {t.__struct_config__.tag for t in typing.get_args(TenantRequest)}
    assert tags == set(subjects.TENANT_CTL_OPS)


async def test_a_tenant_flooding_requests_is_refused_at_once_and_others_are_served(
    stack: tuple[NATS, Client],
) -> None:
    """Requests published without waiting for answers: past MAX_IN_FLIGHT_PER_TENANT the
    flooding tenant is refused at once (retryable), and another tenant's submit is served."""
    _, client = stack
    flooder, other = uid("flood"), uid("calm")
    inbox = client.nc.new_inbox()
    replies: list[object] = []

    async def collect(msg: Msg) -> None:
        replies.append(decode(TENANT_REPLY_DECODER, msg.data))

    sub = await client.nc.subscribe(f"{inbox}.*", cb=collect)
    plan = PlanDataset(flooder, "d", [ManifestFile("f.bin", 1, "0" * 64)])
    for i in range(80):  # heavy requests: each holds the master's object store a while
        await client.nc.publish(
            subjects.tenant_ctl(flooder, "dataset-plan"), encode(plan), reply=f"{inbox}.{i}"
        )
    await client.nc.flush()
    served = await client.request(other, SubmitJob(other, uid("j"), b"{}"))
    assert isinstance(served, Queued)
    await eventually(lambda: len(replies) == 80 or None, timeout=60, what="80 answers")
    busy = [r for r in replies if isinstance(r, CtlError)]
    assert busy and all(r.code == "unavailable" and r.retryable for r in busy)
    assert all("requests are in flight already" in r.message for r in busy)
    assert {type(r) for r in replies} <= {CtlError, DatasetPlan}
    await sub.unsubscribe()


async def test_an_answer_past_the_servers_max_payload_is_an_error_not_silence(
    fresh_server: EmbeddedServer, tmp_path: Path
) -> None:
    nc = await connect(fresh_server.url)
    js = nc.jetstream()
    await declare(js)
    tenant = uid("acme")
    for step in range(1, 4):
        await progress(js, tenant, "j", step)
    queries = await Queries.on_bus(js, DatasetCache(tmp_path))
    await queries.subscribe(nc)
    queries._max_payload = 64  # as a server whose max_payload an operator set very low
    client = await Client.connect(fresh_server.url)
    try:
        with pytest.raises(RequestError, match="more than the server's max_payload") as refused:
            await client.read_events(ReadEvents(tenant, "j"))
        assert refused.value.code == "invalid"
    finally:
        await client.close()
        await queries.close()
        await nc.close()


async def test_the_follower_keeps_its_timeout_when_no_master_answers(
    fresh_server: EmbeddedServer,
) -> None:
    async with await Client.connect(fresh_server.url) as client:
        follower = EventFollower(client.nc, client.read_events, "acme", "j", poll_s=0.2)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await follower.next(1.0)
        assert time.monotonic() - started < 4.0  # not the 10 s of one request
        await follower.close()


async def test_a_wait_skips_an_event_of_a_kind_it_does_not_know(
    stack: tuple[NATS, Client],
) -> None:
    """Found by an audit: an event of a newer kind ended a tenant's ``Job.wait()`` with a
    raw DecodeError, though the job went on (the low-level client skipped such events)."""
    nc, client = stack
    tenant, job = uid("acme"), uid("j")
    js = nc.jetstream()
    await publish_event(js, StateChanged(tenant, job, "running", time.time()), "running")
    newer = msgspec.msgpack.encode({"type": "newkind", "tenant": tenant, "job_id": job})
    await js.publish(subjects.event(tenant, job, "newkind"), newer)
    await publish_event(js, Progress(tenant, job, 3, 0, {"loss": 0.5}, time.time()))
    await publish_event(js, StateChanged(tenant, job, "succeeded", time.time()), "succeeded")
    result = await asyncio.wait_for(Job(client, tenant, job).wait(), 30)
    assert result.status == "succeeded" and result.metrics == {"loss": 0.5}
