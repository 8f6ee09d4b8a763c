"""The broker keeps tenants apart: with tenant bob's credentials, every attempt on tenant
alice's things fails with the server's permission error, and nothing of alice's is reached
or changed. Positive controls in the same test show alice (and bob, on his own things) can
do what they are allowed, so the denials are not an artefact of a broken connection.
Tenants get no JetStream at all, not even on their own things, and requests whose reply
subject names another's KV entry, stream subject or inbox are answered nowhere: the server
would otherwise write its (or a service's) answer there.

A real ``nats-server`` runs with the authorization config rendered from the identities
registry (:mod:`bus.auth`); the service identity declares the real layout and writes alice's
events, job record, checkpoint and bucket content. A revoked tenant is disconnected at the
reload and cannot reconnect; a rotated key replaces the old one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import MaxPayloadError
from nats.js.api import AckPolicy, ConsumerConfig

from bus import tenantadmin
from bus.auth import load_registry, render
from bus.codec import decode, encode
from bus.connect import connect
from bus.datacache import DatasetCache
from bus.declare import declare
from bus.identity import IdentityError, creds_path, load_creds
from bus.inference import observation
from bus.records import put_job, put_policy
from bus.server import EmbeddedServer
from schemas import subjects as s
from schemas.jobs import JobRecord, job_key
from schemas.model import HeadConfig, OptimizerConfig
from schemas.tenantctl import (
    TENANT_REPLY_DECODER,
    CancelJob,
    CtlError,
    EventsPage,
    JobsReply,
    ListJobs,
    ReadEvents,
    SamplePolicy,
    SubmitJob,
)
from schemas.tenants import TENANT_RECORD_DECODER
from schemas.train import OpenSlot, PolicyRecord
from services.master.queries import MAX_IN_FLIGHT_PER_TENANT, Queries
from tests.helpers import eventually, uid

pytestmark = pytest.mark.timeout(120)


@dataclass
class Tenant:
    """A tenant's connection, the errors its server sent it, and replies on its inbox."""

    name: str
    nc: NATS
    errors: list[str] = field(default_factory=list)
    replies: list[Msg] = field(default_factory=list)

    async def denied(self, subject: str, kind: str = "publish") -> None:
        """Wait for the server's permissions violation naming ``subject``."""
        want = f'permissions violation for {kind} to "{subject.lower()}"'
        await eventually(
            lambda: any(want in e for e in self.errors), timeout=5, what=f"violation {want!r}"
        )

    async def attempt(self, subject: str, payload: bytes = b"", kind: str = "publish") -> None:
        """Publish ``payload`` to ``subject`` with a reply on our inbox and assert the
        server refused it (a denied request reaches nobody, so nothing can answer)."""
        await self.nc.publish(subject, payload, reply=f"{s.tenant_inbox_prefix(self.name)}.r")
        await self.denied(subject, kind)


@dataclass
class Secured:
    home: Path
    server: EmbeddedServer
    service: NATS

    def creds(self, name: str) -> Path:
        return creds_path(tenantadmin.creds_dir(self.home), name)

    async def tenant(self, name: str) -> Tenant:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        nc = await connect(self.server.url, creds=self.creds(name), error_cb=on_error)
        t = Tenant(name, nc, errors)

        async def on_reply(msg: Msg) -> None:
            t.replies.append(msg)

        await nc.subscribe(f"{s.tenant_inbox_prefix(name)}.r", cb=on_reply)
        return t


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A home with the service, operator and two tenants registered."""
    tenantadmin.init_home(tmp_path)
    for name in ("alice", "bob"):
        tenantadmin.ensure_tenant(tmp_path, name)
    yield tmp_path


@pytest_asyncio.fixture
async def secured(home: Path) -> AsyncIterator[Secured]:
    server = EmbeddedServer(
        tenantadmin.server_dir(home),
        log_file=home / tenantadmin.SERVER_LOG,
        auth=render(load_registry(home)),
    ).start()
    service = await connect(server.url, creds=creds_path(tenantadmin.creds_dir(home), "service"))
    try:
        await declare(service.jetstream())
        await tenantadmin.sync_bus(service, load_registry(home))
        yield Secured(home, server, service)
    finally:
        await service.close()
        server.stop()


async def alice_things(sec: Secured) -> dict[str, object]:
    """What the services hold of alice's: events, a job record, a checkpoint, bucket
    content, the master's durables, and an ephemeral consumer of hers."""
    js = sec.service.jetstream()
    job = uid("job")
    for kind in ("accepted", "progress"):
        await js.publish(s.event("alice", job, kind), b"alice's " + kind.encode())
    record = JobRecord("alice", job, "sft", "running", b'{"secret": 1}', 1.0, 1.0)
    jobs = await js.key_value(s.KV_JOBS)
    await jobs.put(job_key("alice", job), encode(record))
    checkpoints = await js.object_store(s.OBJ_CHECKPOINTS)
    await checkpoints.put(f"alice/{job}/v1", b"alice's weights")
    bucket = await js.object_store(s.tenant_bucket("alice"))
    await bucket.put("datasets/d1/data.parquet", b"alice's data")
    await js.add_consumer(
        s.STREAM_JOBS,
        ConsumerConfig(durable_name="master", filter_subject="nexus.job.>"),
    )
    await js.add_consumer(
        s.STREAM_EVENTS,
        ConsumerConfig(durable_name="master-events", filter_subject="nexus.event.*.*.>"),
    )
    await js.add_consumer(
        s.STREAM_EVENTS,
        ConsumerConfig(
            name="alice-view",
            filter_subject="nexus.event.alice.>",
            ack_policy=AckPolicy.EXPLICIT,
            inactive_threshold=60,
        ),
    )
    return {"job": job}


async def snapshot(sec: Secured, job: str) -> dict[str, object]:
    """Everything of alice's the attacks could change, read as the service."""
    js = sec.service.jetstream()
    streams = {}
    for name in (s.STREAM_JOBS, s.STREAM_EVENTS, f"OBJ_{s.tenant_bucket('alice')}"):
        info = await js.stream_info(name)
        streams[name] = (info.state.messages, info.state.last_seq, info.config.max_bytes)
    consumers = {}
    for stream, name in (
        (s.STREAM_JOBS, "master"),
        (s.STREAM_EVENTS, "master-events"),
        (s.STREAM_EVENTS, "alice-view"),
    ):
        info = await js.consumer_info(stream, name)
        consumers[name] = (
            info.config.filter_subject,
            info.delivered.stream_seq,
            info.num_pending,
            info.num_ack_pending,
        )
    jobs = await js.key_value(s.KV_JOBS)
    entry = await jobs.get(job_key("alice", job))
    names = sorted(str(info.config.name) for info in await js.streams_info())
    return {"streams": streams, "consumers": consumers, "record": entry.value, "names": names}


@pytest_asyncio.fixture
async def master(secured: Secured, tmp_path: Path) -> AsyncIterator[Queries]:
    """The master's responders to tenants' requests, running as the service identity."""
    js = secured.service.jetstream()
    queries = await Queries.on_bus(js, DatasetCache(tmp_path / "cache"))
    await queries.subscribe(secured.service)
    yield queries
    await queries.close()


async def test_bob_reaches_nothing_of_alice(secured: Secured, master: Queries) -> None:
    sec = secured
    job = str((await alice_things(sec))["job"])
    alice = await sec.tenant("alice")
    bob = await sec.tenant("bob")
    try:
        # -- positive controls: alice's own things work, through the master ---------------
        live: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_live(msg: Msg) -> None:
            await live.put(msg)

        await alice.nc.subscribe("nexus.event.alice.>", cb=on_live)
        await alice.nc.flush()
        jobs = await _ask(alice, s.tenant_ctl("alice", "jobs"), encode(ListJobs("alice")))
        assert isinstance(jobs, JobsReply) and [r.job_id for r in jobs.records] == [job]
        page = await _ask(alice, s.tenant_ctl("alice", "events"), encode(ReadEvents("alice", job)))
        assert isinstance(page, EventsPage)
        assert [e.subject for e in page.events] == [
            s.event("alice", job, "accepted"),
            s.event("alice", job, "progress"),
        ]
        # bob's own requests work too (his connection is not simply broken)
        mine = await _ask(bob, s.tenant_ctl("bob", "jobs"), encode(ListJobs("bob")))
        assert isinstance(mine, JobsReply) and mine.records == []
        assert alice.errors == [] and bob.errors == []
        before = await snapshot(sec, job)

        # -- no JetStream at all, not even on a tenant's own things (it would let the
        #    server answer onto a reply subject the tenant names) -------------------------
        api = "$JS.API"
        for subject in (
            s.job("alice", "submit"),
            f"{api}.INFO",
            f"{api}.CONSUMER.CREATE.EVENTS.own.nexus.event.alice.>",
            f"$O.{s.tenant_bucket('alice')}.M.planted",
            f"{api}.STREAM.INFO.OBJ_{s.tenant_bucket('alice')}",
        ):
            await alice.attempt(subject, b"{}")
        alice.errors.clear()

        # -- bob on alice's job subjects and requests ---------------------------------------
        for verb in ("cancel", "submit", "pause"):
            await bob.attempt(s.job("alice", verb), b"{}")
        await bob.attempt(s.tenant_ctl("alice", "jobs"))
        await bob.attempt(s.tenant_ctl("alice", "cancel"), encode(CancelJob("alice", job)))
        await bob.attempt(s.tenant_ctl("alice", "events"), encode(ReadEvents("alice", job)))
        # the operators' controls of the services: an env worker's sessions
        await bob.attempt(s.ENVS_PREWARM, b"")
        # the bill: a forged usage report would charge alice (or clear bob's own)
        await bob.attempt(s.usage("trainer", "forged"), b"{}")
        # on his own subject, claiming alice: the master refuses it by name
        claim = await _ask(bob, s.tenant_ctl("bob", "cancel"), encode(CancelJob("alice", job)))
        assert isinstance(claim, CtlError) and claim.code == "tenant_mismatch"

        # -- replies aimed at alice's things: the services answer only on bob's inbox ------
        targets = (
            f"$KV.{s.KV_JOBS}.{job_key('alice', job)}",
            s.event("alice", job, "state"),
            s.job("alice", "submit"),
            f"{s.tenant_inbox_prefix('alice')}.r",
            f"$O.{s.tenant_bucket('alice')}.M.planted",
        )
        for target in targets:
            for subject, body in (
                (s.tenant_ctl("bob", "jobs"), encode(ListJobs("bob"))),
                (s.tenant_ctl("bob", "events"), encode(ReadEvents("bob", "x"))),
                (s.tenant_ctl("bob", "submit"), encode(SubmitJob("bob", uid("j"), b"{}"))),
                (s.BACKBONES_QUERY, b""),
            ):
                await bob.nc.publish(subject, body, reply=target)
        await bob.nc.flush()

        # -- subscribe to alice's events, her inbox, anyone's inbox, the backbone ---------
        got: list[Msg] = []

        async def collect(msg: Msg) -> None:
            got.append(msg)

        for subject in (
            "nexus.event.alice.>",
            "nexus.event.>",
            f"{s.tenant_inbox_prefix('alice')}.>",
            "_INBOX.>",
            ">",
            "nexus.train.>",
            "nexus.usage.>",  # every tenant's usage, as the services report it
            f"$O.{s.tenant_bucket('alice')}.>",
        ):
            await bob.nc.subscribe(subject, cb=collect)
            await bob.denied(subject, "subscription")

        # -- consumers on alice's events, pulls from existing consumers -------------------
        alice_filter = ConsumerConfig(
            name="bob-spy", filter_subject="nexus.event.alice.>", deliver_subject="_INBOX_bob.x"
        )
        body = json.dumps({"stream_name": "EVENTS", "config": alice_filter.as_dict()}).encode()
        for subject in (
            f"{api}.CONSUMER.CREATE.EVENTS.bob-spy.nexus.event.alice.>",
            f"{api}.CONSUMER.CREATE.EVENTS.bob-spy.nexus.event.bob.>",
            f"{api}.CONSUMER.CREATE.EVENTS",
            f"{api}.CONSUMER.CREATE.EVENTS.bob-spy",
            f"{api}.CONSUMER.DURABLE.CREATE.EVENTS.bob-spy",
            f"{api}.CONSUMER.CREATE.EVENTS.master-events.nexus.event.bob.>",
        ):
            await bob.attempt(subject, body)
        for stream, consumer in (
            (s.STREAM_JOBS, "master"),
            (s.STREAM_EVENTS, "master-events"),
            (s.STREAM_EVENTS, "alice-view"),
        ):
            await bob.attempt(f"{api}.CONSUMER.MSG.NEXT.{stream}.{consumer}", b'{"batch": 5}')
            await bob.attempt(f"{api}.CONSUMER.INFO.{stream}.{consumer}")
            await bob.attempt(f"{api}.CONSUMER.DELETE.{stream}.{consumer}")

        # -- alice's job record in the jobs KV ----------------------------------------------
        key = job_key("alice", job)
        await bob.attempt(f"$KV.{s.KV_JOBS}.{key}", b"overwritten")
        await bob.attempt(f"{api}.STREAM.INFO.KV_{s.KV_JOBS}")
        await bob.attempt(
            f"{api}.STREAM.MSG.GET.KV_{s.KV_JOBS}",
            json.dumps({"last_by_subj": f"$KV.{s.KV_JOBS}.{key}"}).encode(),
        )
        await bob.attempt(f"{api}.DIRECT.GET.KV_{s.KV_JOBS}.$KV.{s.KV_JOBS}.{key}")
        await bob.attempt(f"{api}.DIRECT.GET.KV_{s.KV_TENANTS}")
        # -- checkpoints and the tenants' buckets (his own included) --------------------------
        for bucket in (s.OBJ_CHECKPOINTS, s.tenant_bucket("alice"), s.tenant_bucket("bob")):
            stream = f"OBJ_{bucket}"
            await bob.attempt(f"{api}.STREAM.INFO.{stream}")
            await bob.attempt(f"{api}.CONSUMER.CREATE.{stream}", b"{}")
            await bob.attempt(f"{api}.DIRECT.GET.{stream}", b'{"seq": 1}')
            await bob.attempt(f"{api}.STREAM.MSG.GET.{stream}", b'{"seq": 1}')
            await bob.attempt(f"{api}.STREAM.PURGE.{stream}", b"{}")
            await bob.attempt(f"$O.{bucket}.M.planted", b"{}")

        # -- stream admin and the account's JetStream API ------------------------------------
        for subject in (
            f"{api}.STREAM.PURGE.{s.STREAM_EVENTS}",
            f"{api}.STREAM.DELETE.{s.STREAM_EVENTS}",
            f"{api}.STREAM.DELETE.{s.STREAM_JOBS}",
            f"{api}.STREAM.UPDATE.OBJ_{s.tenant_bucket('bob')}",
            f"{api}.STREAM.DELETE.OBJ_{s.tenant_bucket('bob')}",
            f"{api}.STREAM.CREATE.bobs",
            f"{api}.STREAM.MSG.DELETE.{s.STREAM_EVENTS}",
            f"{api}.INFO",
            f"{api}.STREAM.LIST",
            f"{api}.STREAM.NAMES",
            f"{api}.CONSUMER.LIST.{s.STREAM_EVENTS}",
            f"{api}.CONSUMER.NAMES.{s.STREAM_EVENTS}",
        ):
            await bob.attempt(subject, b"{}")
        # nothing of the backbone either: bob cannot plant work or control messages
        for subject in ("nexus.train.tiny.alice", "nexus.env.alice.j", "nexus.event.alice.j.x"):
            await bob.attempt(subject, b"{}")

        # -- nothing reached bob, nothing of alice's changed ---------------------------------
        await bob.nc.flush()
        await alice.nc.flush()
        await sec.service.jetstream().publish(s.event("alice", job, "state"), b"after")
        after_live = await asyncio.wait_for(live.get(), 10)
        assert after_live.data == b"after"  # the only event alice saw: nothing planted
        assert live.empty()
        after = await snapshot(sec, job)
        before_events = before["streams"][s.STREAM_EVENTS]  # type: ignore[index]
        after_events = after["streams"][s.STREAM_EVENTS]  # type: ignore[index]
        assert after_events[0] == before_events[0] + 1  # only the service's own publish
        # bob's own submits (queued by the master) are the only new JOBS messages
        before_jobs = before["streams"][s.STREAM_JOBS]  # type: ignore[index]
        after_jobs = after["streams"][s.STREAM_JOBS]  # type: ignore[index]
        assert after_jobs[0] == before_jobs[0] + len(targets)
        for bucket_stream in (f"OBJ_{s.tenant_bucket('alice')}",):
            assert after["streams"][bucket_stream] == before["streams"][bucket_stream]  # type: ignore[index]
        assert after["record"] == before["record"]
        assert after["names"] == before["names"]
        b_consumers = before["consumers"]
        a_consumers = after["consumers"]
        assert isinstance(a_consumers, dict) and isinstance(b_consumers, dict)
        for name in ("alice-view", "master-events"):
            # same filter, nothing delivered (to bob or anyone), one more pending: the
            # service's own event above
            filter_, delivered, pending, acks = b_consumers[name]
            assert a_consumers[name] == (filter_, delivered, pending + 1, acks)
        assert got == [] and bob.replies == [] and alice.replies == []
        with pytest.raises(NatsError):
            await sec.service.jetstream().consumer_info(s.STREAM_EVENTS, "bob-spy")
        assert alice.errors == []  # alice was never affected
    finally:
        await alice.nc.close()
        await bob.nc.close()


async def _ask(tenant: Tenant, subject: str, body: bytes) -> object:
    """One request on ``subject``, answered on the tenant's own inbox."""
    reply = await tenant.nc.request(subject, body, timeout=5)
    return decode(TENANT_REPLY_DECODER, reply.data)


async def test_a_tenant_cannot_have_a_services_answer_delivered_into_a_services_inbox(
    secured: Secured, master: Queries
) -> None:
    """A service's connection has inboxes of its own prefix (its pull consumers' deliveries
    arrive there; a tenant learns their names from the reply subjects of the events it
    watches). A tenant naming one as the reply of its request gets nothing answered there: an
    answer in a pull consumer's inbox stopped that service's consume loop."""
    assert secured.service.new_inbox().startswith(f"{s.SERVICE_INBOX_PREFIX}.")
    landed: list[Msg] = []

    async def collect(msg: Msg) -> None:
        landed.append(msg)

    await secured.service.subscribe(f"{s.SERVICE_INBOX_PREFIX}.probe.>", cb=collect)
    await secured.service.flush()
    alice = await secured.tenant("alice")
    try:
        # An op the master does not know is answered too (with its error): not there either.
        for i, op in enumerate(("jobs", "no-such-op", "jobs", "no-such-op")):
            await alice.nc.publish(
                f"{s.PREFIX}.ctl.tenant.alice.{op}",
                encode(ListJobs("alice")),
                reply=f"{s.SERVICE_INBOX_PREFIX}.probe.{i}",
            )
        # Requests are answered as they come: once two later ones are, the probes were seen.
        for _ in range(2):
            await _ask(alice, s.tenant_ctl("alice", "jobs"), encode(ListJobs("alice")))
        await secured.service.flush()
        assert landed == []
    finally:
        await alice.nc.close()


async def test_a_tenants_waiting_requests_leave_the_master_to_the_others(
    secured: Secured, master: Queries
) -> None:
    """Alice's acts wait for an inferencer (none runs) until their timeout. Bob's request is
    answered meanwhile: before, her 16 requests in flight held all 16 of the master's shared
    slots, and Bob waited for her timeouts."""
    js = secured.service.jetstream()
    now = time.time()
    spec = (
        b'{"kind":"session","tenant":"alice","head":{"kind":"oft","action_dim":2,"proprio_dim":4}}'
    )
    await put_job(
        await js.key_value(s.KV_JOBS),
        JobRecord("alice", "j1", "session", "running", spec, now, now),
        last=0,
    )
    head = HeadConfig("oft", action_dim=2, chunk_len=1, proprio_dim=4)
    slot = OpenSlot("alice", "j1", head, OptimizerConfig(), seed=0, total_steps=2)
    record = PolicyRecord("alice", "j1", 1, 1, "alice/j1/v000001-x", "0" * 64, 1, slot, now)
    await put_policy(await js.key_value(s.KV_POLICIES), record, last=0)
    alice, bob = await secured.tenant("alice"), await secured.tenant("bob")
    obs = observation([np.zeros((64, 64, 3), np.uint8)], "x", np.zeros(4, np.float32))
    act = encode(SamplePolicy("alice", "j1", [obs], timeout_s=20.0))
    try:
        acts = [
            asyncio.create_task(alice.nc.request(s.tenant_ctl("alice", "act"), act, timeout=40))
            for _ in range(MAX_IN_FLIGHT_PER_TENANT)
        ]
        await eventually(
            lambda: master._in_flight["alice"] == MAX_IN_FLIGHT_PER_TENANT,
            timeout=10,
            what="alice's acts in flight",
        )
        loop = asyncio.get_running_loop()
        asked = loop.time()
        assert isinstance(
            await _ask(bob, s.tenant_ctl("bob", "jobs"), encode(ListJobs("bob"))), JobsReply
        )
        assert loop.time() - asked < 5  # not after alice's 20 s timeouts
        for task in acts:
            task.cancel()
        await asyncio.gather(*acts, return_exceptions=True)
    finally:
        await alice.nc.close()
        await bob.nc.close()


async def test_revoked_tenant_is_disconnected_and_cannot_return(secured: Secured) -> None:
    sec = secured
    tenantadmin.ensure_tenant(sec.home, "carol")
    await tenantadmin.apply(sec.home, sec.server.url)
    carol_creds = sec.creds("carol")
    kept = carol_creds.read_text()
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    carol = await connect(sec.server.url, creds=carol_creds, error_cb=on_error)
    await carol.publish(s.tenant_ctl("carol", "jobs"), encode(ListJobs("carol")))
    await carol.flush()
    assert errors == []

    tenantadmin.revoke_tenant(sec.home, "carol")
    applied = await tenantadmin.apply(sec.home, sec.server.url)
    assert applied.reloaded and applied.synced
    assert not carol_creds.exists()
    # the server drops carol's connection at the reload; her reconnects are refused
    await eventually(lambda: any("authorization violation" in e for e in errors), timeout=10)
    assert not carol.is_connected
    await carol.close()
    kept_path = sec.home / "kept.creds"
    kept_path.write_text(kept)
    with pytest.raises(NatsError, match="Authorization Violation"):
        # with reconnects on (the default), a refused key still fails at once, not forever
        await asyncio.wait_for(connect(sec.server.url, creds=kept_path), 10)
    # the tenants KV says revoked, so the master refuses work that got in any other way
    kv = await sec.service.jetstream().key_value(s.KV_TENANTS)
    record = TENANT_RECORD_DECODER.decode((await kv.get("carol")).value or b"")
    assert record.revoked


async def test_rotated_key_works_and_the_old_one_does_not(secured: Secured) -> None:
    sec = secured
    old_text = sec.creds("alice").read_text()
    old_key = load_creds(sec.creds("alice")).public_key
    new_path = tenantadmin.rotate_tenant(sec.home, "alice")
    await tenantadmin.apply(sec.home, sec.server.url)
    assert load_creds(new_path).public_key != old_key
    old_path = sec.home / "old.creds"
    old_path.write_text(old_text)
    with pytest.raises(NatsError, match="Authorization Violation"):
        await connect(sec.server.url, creds=old_path, max_reconnect_attempts=0)
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    alice = await connect(
        sec.server.url, creds=new_path, max_reconnect_attempts=0, error_cb=on_error
    )
    try:
        await alice.publish(s.tenant_ctl("alice", "jobs"), encode(ListJobs("alice")))
        await alice.flush()
        assert errors == [] and alice.is_connected
    finally:
        await alice.close()
    kv = await sec.service.jetstream().key_value(s.KV_TENANTS)
    record = TENANT_RECORD_DECODER.decode((await kv.get("alice")).value or b"")
    assert record.public_key == load_creds(new_path).public_key and record.rotated_at > 0


async def test_storage_limit_is_the_buckets_max_bytes(secured: Secured) -> None:
    """The tenant's bucket (written only by the master, for the tenant) holds at most the
    tenant's storage limit."""
    sec = secured
    tenantadmin.set_limits(sec.home, "bob", max_storage=4096)
    await tenantadmin.apply(sec.home, sec.server.url)
    bucket = await sec.service.jetstream().object_store(s.tenant_bucket("bob"))
    await bucket.put("small", b"x" * 1000)
    with pytest.raises(NatsError):
        await bucket.put("large", b"x" * 10_000)
    info = await sec.service.jetstream().stream_info(f"OBJ_{s.tenant_bucket('bob')}")
    assert info.config.max_bytes == 4096


def test_a_tampered_creds_file_is_refused(home: Path) -> None:
    path = creds_path(tenantadmin.creds_dir(home), "alice")
    text = path.read_text()
    other = load_creds(creds_path(tenantadmin.creds_dir(home), "bob")).public_key
    bad = home / "bad.creds"
    bad.write_text(text.replace(load_creds(path).public_key, other))
    with pytest.raises(IdentityError, match="is not the named"):
        load_creds(bad)


async def test_per_connection_limits_apply_at_the_reload(secured: Secured) -> None:
    sec = secured
    tenantadmin.set_server_limits(sec.home, max_payload=4096)
    await tenantadmin.apply(sec.home, sec.server.url)
    bob = await connect(sec.server.url, creds=sec.creds("bob"))
    try:
        assert bob.max_payload == 4096
        with pytest.raises(MaxPayloadError):
            await bob.publish(s.tenant_ctl("bob", "jobs"), b"x" * 5000)
        await bob.publish(s.tenant_ctl("bob", "jobs"), b"x" * 1000)
        await bob.flush()
        assert bob.is_connected
    finally:
        await bob.close()
