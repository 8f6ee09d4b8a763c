"""The master's answers to tenants: every event has an identity-derived ``Nats-Msg-Id`` (a
replayed publish is a no-op), and every submit whose envelope decodes is answered with a
``rejected`` event naming what was wrong, whatever headers the client set."""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

import bus.publish as bus_publish
from bus.codec import decode, encode
from bus.connect import connect
from bus.declare import declare
from bus.publish import publish_event
from bus.server import EmbeddedServer
from schemas import headers, subjects
from schemas.events import EVENT_DECODER, Accepted, Rejected, StateChanged
from schemas.jobs import JobSubmit
from services.envs.describe import Describer
from services.master.service import Master
from tests.conftest import Procs
from tests.helpers import start_service, uid


async def _stored(js: JetStreamContext, subject: str) -> int:
    """Messages the EVENTS stream holds on ``subject``."""
    info = await js.stream_info(subjects.STREAM_EVENTS, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def _first_event(js: JetStreamContext, tenant: str, job_id: str) -> object:
    sub = await js.subscribe(subjects.events_of_job(tenant, job_id), ordered_consumer=True)
    try:
        return decode(EVENT_DECODER, (await sub.next_msg(timeout=30)).data)
    finally:
        await sub.unsubscribe()


def _rl_spec(tenant: str) -> bytes:
    """A valid job spec whose plan needs no dataset on disk."""
    spec = {
        "kind": "rl",
        "tenant": tenant,
        "env": "JoyNexus/Reach2D-v0",
        "head": {"kind": "oft", "action_dim": 2, "value_head": True},
        "iterations": 1,
    }
    return json.dumps(spec).encode()


@pytest_asyncio.fixture
async def own_nc(fresh_server: EmbeddedServer) -> AsyncIterator[NATS]:
    """A server of this test alone: the master under test publishes slot and env tasks that
    no other test's trainer or env worker may pick up."""
    nc = await connect(fresh_server.url, name="pytest-master")
    await declare(nc.jetstream())
    yield nc
    await nc.close()


@pytest.fixture
def own_js(own_nc: NATS) -> JetStreamContext:
    return own_nc.jetstream()


async def _master(js: JetStreamContext) -> Master:
    return Master(
        js,
        await js.key_value(subjects.KV_JOBS),
        await js.key_value(subjects.KV_POLICIES),
    )


async def test_republishing_a_logical_event_stores_it_once(own_js: JetStreamContext) -> None:
    """A replay re-creates an event with a new ``at``; its msg id must not change with it."""
    tenant, job = uid("acme"), "j1"
    await publish_event(own_js, Accepted(tenant, job, "sft", 1.0))
    await publish_event(own_js, Accepted(tenant, job, "sft", 2.0))
    assert await _stored(own_js, subjects.event(tenant, job, "accepted")) == 1

    await publish_event(own_js, StateChanged(tenant, job, "running", 3.0), "running")
    await publish_event(own_js, StateChanged(tenant, job, "running", 4.0), "running")
    await publish_event(own_js, StateChanged(tenant, job, "failed", 5.0, "boom"), "failed")
    assert await _stored(own_js, subjects.event(tenant, job, "state")) == 2, (
        "one per status entered"
    )


@pytest.mark.parametrize("failure", ["before_store", "after_store"])
async def test_submit_redelivered_after_a_failed_announcement_is_announced_once(
    own_nc: NATS, own_js: JetStreamContext, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """The master recorded the job, then its ``accepted`` publish failed: lost before the
    server stored it (a crash, a dropped connection), or stored with the ack lost (a
    timeout). The submit is redelivered; the tenant must see exactly one ``accepted``."""
    tenant, job = uid("acme"), "rl-1"
    # The master announces through bus.publish.publish_event, which publishes from there.
    real_publish = bus_publish.publish
    failed: list[str] = []

    async def flaky(js: JetStreamContext, subject: str, message: Any, **kw: Any) -> Any:
        if isinstance(message, Accepted) and not failed:
            failed.append(subject)
            if failure == "after_store":
                await real_publish(js, subject, message, **kw)
            raise ConnectionError(f"publish to {subject} failed ({failure})")
        return await real_publish(js, subject, message, **kw)

    monkeypatch.setattr(bus_publish, "publish", flaky)
    describer = Describer()  # the env worker's describe answers (the spec names an env)
    await describer.subscribe(own_nc)
    master = await _master(own_js)
    submit = Msg(
        own_nc,
        subject=subjects.job(tenant, "submit"),
        data=encode(JobSubmit(tenant, job, _rl_spec(tenant), 0.0)),
    )
    with pytest.raises(ConnectionError):
        await master.handle(submit)
    assert failed, "the accepted publish was not reached"
    await master.handle(submit)  # the redelivery
    await describer.close()

    record = await master.record(tenant, job)
    assert record is not None and record[0].status == "running"
    assert await _stored(own_js, subjects.event(tenant, job, "accepted")) == 1
    assert await _stored(own_js, subjects.event(tenant, job, "state")) == 1


async def test_rejection_of_a_redelivered_dead_command_is_stored_once(
    own_js: JetStreamContext,
) -> None:
    """``on_dead`` runs again when the master dies between dead-lettering a command and
    terminating it; the tenant is told once. (The SDK's job-id header is set, so this holds
    on that path as well as on the decoded-envelope one.)"""
    tenant, job = uid("acme"), "bad-1"
    await own_js.publish(
        subjects.job(tenant, "submit"),
        encode(JobSubmit(tenant, job, b"{}", 0.0)),
        headers={headers.JOB_ID: job},
    )
    sub = await own_js.pull_subscribe(subjects.job(tenant, "submit"), durable=uid("d"))
    (msg,) = await sub.fetch(1, timeout=5)
    master = await _master(own_js)
    await master.on_dead(msg, "invalid job spec: kind: Field required", ValueError())
    await master.on_dead(msg, "invalid job spec: kind: Field required", ValueError())
    assert await _stored(own_js, subjects.event(tenant, job, "rejected")) == 1


@pytest.fixture
def master_proc(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> subprocess.Popen[bytes]:
    return procs.add(start_service("master", nats_server.url, tmp_path / "master.log"))


async def test_bad_spec_submitted_without_headers_gets_a_rejected_event_naming_the_field(
    master_proc: subprocess.Popen[bytes], js: JetStreamContext
) -> None:
    """A client written from the README sends a JobSubmit and nothing else."""
    tenant, job = uid("acme"), "bad-spec"
    spec = {"kind": "sft", "tenant": tenant, "dataset": "d", "steps": 5, "optimiser": {}}
    spec["head"] = {"kind": "oft", "action_dim": 2}
    await js.publish(
        subjects.job(tenant, "submit"),
        encode(JobSubmit(tenant, job, json.dumps(spec).encode(), 0.0)),
    )
    event = await _first_event(js, tenant, job)
    assert isinstance(event, Rejected), event
    assert "optimiser: unknown field" in event.reason


async def test_submit_for_another_tenant_is_rejected_to_its_sender_only(
    master_proc: subprocess.Popen[bytes], js: JetStreamContext
) -> None:
    """The subject's tenant is who sent it (the broker enforces that); the message's
    tenant claims to be someone else. The sender hears why; the other tenant hears
    nothing."""
    sender, victim, job = uid("mallory"), uid("alice"), "j-1"
    await js.publish(
        subjects.job(sender, "submit"),
        encode(JobSubmit(victim, job, _rl_spec(victim), 0.0)),
    )
    event = await _first_event(js, sender, job)
    assert isinstance(event, Rejected), event
    assert event.tenant == sender
    assert f"tenant {victim!r}" in event.reason and f"tenant {sender!r}" in event.reason
    assert master_proc.poll() is None
    for kind in ("rejected", "accepted", "state"):
        assert await _stored(js, subjects.event(victim, job, kind)) == 0
