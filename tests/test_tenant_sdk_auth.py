"""The tenant SDK works with nothing but a tenant's identity: on a server with the real
authorization config (:mod:`bus.auth`), tenant alice pushes a dataset, adds it, lists it,
reads her job records, follows her job's events and exports her policy — every one through
the subjects her permissions allow — and the server logs no permissions violation for her.
Bob, with his own identity, gets none of it."""

from __future__ import annotations

import io
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from bus import tenantadmin
from bus.auth import load_registry, render
from bus.checkpoints import digest
from bus.codec import encode
from bus.connect import connect
from bus.datacache import DatasetCache
from bus.declare import declare
from bus.identity import creds_path
from bus.records import put_job, put_policy
from bus.server import EmbeddedServer
from clients.sdk import Client, Job, RequestError
from schemas import subjects
from schemas.events import Progress, StateChanged
from schemas.jobs import JobRecord
from schemas.model import HeadConfig, OptimizerConfig
from schemas.tenantctl import PART_BYTES, ListJobs
from schemas.train import OpenSlot, PolicyRecord
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID
from services.master.queries import Queries

pytestmark = pytest.mark.timeout(180)


@dataclass
class Secured:
    home: Path
    server: EmbeddedServer
    service: NATS

    def creds(self, name: str) -> Path:
        return creds_path(tenantadmin.creds_dir(self.home), name)


@pytest_asyncio.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Secured]:
    """A server with alice and bob registered, the layout declared by the service identity
    and the master's responders running as the service."""
    home = tmp_path / "home"
    tenantadmin.init_home(home)
    for name in ("alice", "bob"):
        tenantadmin.ensure_tenant(home, name)
    server = EmbeddedServer(
        tenantadmin.server_dir(home),
        log_file=home / tenantadmin.SERVER_LOG,
        auth=render(load_registry(home)),
    ).start()
    service = await connect(server.url, creds=creds_path(tenantadmin.creds_dir(home), "service"))
    js = service.jetstream()
    await declare(js)
    await tenantadmin.sync_bus(service, load_registry(home))
    queries = await Queries.on_bus(js, DatasetCache(tmp_path / "cache"))
    await queries.subscribe(service)
    try:
        yield Secured(home, server, service)
    finally:
        await queries.close()
        await service.close()
        server.stop()


async def _alice_job(service: NATS, job: str) -> bytes:
    """A job record, a committed policy and its events, written as the services would."""
    js = service.jetstream()
    now = time.time()
    await put_job(
        await js.key_value(subjects.KV_JOBS),
        JobRecord("alice", job, "sft", "succeeded", b"{}", now, now, policy_version=2),
        last=0,
    )
    weights = b"alice's policy weights " * 20000  # more than a part: read back in two
    name = f"alice/{job}/v000002-{digest(weights)[:16]}"
    await (await js.object_store(subjects.OBJ_CHECKPOINTS)).put(name, weights)
    slot = OpenSlot(
        "alice",
        job,
        HeadConfig("oft", action_dim=2, chunk_len=1, proprio_dim=4),
        OptimizerConfig(),
        seed=0,
        total_steps=2,
    )
    policy = PolicyRecord("alice", job, 2, 2, name, digest(weights), 7, slot, now)
    await put_policy(await js.key_value(subjects.KV_POLICIES), policy, last=0)
    for step in (1, 2):
        event = Progress("alice", job, step, 2, {"loss": 1.0 / step}, now)
        await js.publish(subjects.event("alice", job, "progress"), encode(event))
    done = StateChanged("alice", job, "succeeded", now)
    await js.publish(subjects.event("alice", job, "state"), encode(done))
    return weights


async def test_a_tenant_identity_does_its_work_through_the_sdk_and_nothing_else(
    secured: Secured, tmp_path: Path
) -> None:
    data = tmp_path / "reach"
    record(REACH2D_ID, 4, data, seed=0)
    weights = await _alice_job(secured.service, "j1")
    log = secured.server.log_file

    async with await Client.connect(secured.server.url, creds=secured.creds("alice")) as alice:
        pushed = await alice.push_dataset("alice", data, "reach")
        assert pushed.record.source == "pushed" and pushed.record.files == len(
            pushed.report.uploaded
        )
        assert [r.dataset for r in await alice.datasets("alice")] == ["reach"]
        again = await alice.push_dataset("alice", data, "reach")
        assert again.report.uploaded == [], "resumed: every object is already there"

        assert [r.job_id for r in await alice.jobs("alice")] == ["j1"]
        assert alice.tenant == "alice" and await alice.jobs() == await alice.jobs("alice")
        status = await alice.status("alice", "j1")
        assert status is not None and status.status == "succeeded"
        steps = [
            e.step
            async for e in Job(alice, "alice", "j1").events(idle_timeout=10)
            if isinstance(e, Progress)
        ]
        assert steps == [1, 2]
        assert len(weights) > PART_BYTES
        exported = await alice.export_policy("alice", "j1", out_dir=tmp_path / "out")
        assert exported.read_bytes() == weights
    assert _violations(log) == "", "alice did nothing her permissions do not allow"

    async with await Client.connect(secured.server.url, creds=secured.creds("bob")) as bob:
        assert await bob.datasets("bob") == []
        assert await bob.status("bob", "j1") is None
        with pytest.raises(RequestError, match="cannot act for tenant 'alice'"):
            await bob.request("alice", ListJobs("alice"), timeout=2.0)  # refused by the SDK
        with pytest.raises(NatsError):  # and sent anyway, by the broker: it reaches nobody
            await bob.nc.request(
                subjects.tenant_ctl("alice", "jobs"), encode(ListJobs("alice")), timeout=2.0
            )
        with pytest.raises(RequestError, match="no committed policy"):
            await bob.export_policy("bob", "j1", out_dir=tmp_path / "bob")
    assert 'Publish Violation - Subject "nexus.ctl.tenant.alice.jobs"' in _violations(log)


def _violations(log: Path) -> str:
    buf = io.StringIO()
    for line in log.read_text().splitlines():
        if "Violation" in line:
            buf.write(line + "\n")
    return buf.getvalue()
