"""Low-level sessions that must never stall: a call whose caller stopped waiting for it, a
call refused beside another tenant's work, a call that fits ``max_payload`` but not with the
headers the master adds, a session its client gave up opening, a call past ``max_calls``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest

from bench.lowlevel import make_batch
from bus.codec import encode
from bus.connect import connect
from bus.declare import declare
from bus.publish import wire_size
from bus.server import EmbeddedServer
from clients.errors import RequestError
from clients.lowlevel import MAX_UNANSWERED, CallError, ServiceClient, SessionClosed, VLABatch
from schemas import subjects
from schemas.tenantctl import CallSession
from schemas.tenants import TenantLimits, TenantRecord
from schemas.tensor import Tensor
from schemas.train import ForwardBackward, OptimStep
from tests.conftest import Procs
from tests.helpers import eventually, start_service, uid
from tests.test_lowlevel import HEAD, TOKEN_BUDGET


def padded_call(tenant: str, session: str, number: int, wire_bytes: int) -> CallSession:
    """A forward_backward call whose request, with an empty header block, is ``wire_bytes``
    on the wire (its instruction padded)."""
    batch = make_batch(3, size=1)

    def call(instruction: str) -> CallSession:
        fb = ForwardBackward(
            tenant,
            session,
            number,
            Tensor.from_numpy(batch.images),
            [instruction],
            Tensor.from_numpy(batch.proprio),
            Tensor.from_numpy(batch.actions),
        )
        return CallSession(tenant, session, fb)

    base = 70_000  # past 65535 a msgpack string's length prefix no longer grows
    pad = wire_bytes - wire_size(encode(call("x" * base)), {})
    sized = call("x" * (base + pad))
    assert wire_size(encode(sized), {}) == wire_bytes
    return sized


@pytest.mark.timeout(240)
async def test_calls_cancelled_refused_or_near_max_payload_never_stall_a_session(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """Three ways a session (or every session) used to stall: a call whose caller stopped
    waiting was never sent, and every later call waited for it; a call refused beside
    another tenant's work was answered only at the next commit; a call that fit
    ``max_payload`` but not with the headers the master adds to queue it made the server
    close the master's connection."""
    procs.add(start_service("master", fresh_server.url, tmp_path / "master.log"))
    # Commits far apart: an answer that waits for one would show.
    trainer_args = ("--deterministic", "--commit-every-s", "300")
    procs.add(start_service("trainer", fresh_server.url, tmp_path / "trainer.log", *trainer_args))
    a = await ServiceClient.connect(fresh_server.url, tenant=uid("a"))
    b = await ServiceClient.connect(fresh_server.url, tenant=uid("b"))
    try:
        ta = await a.create_training_client(head=HEAD, token_budget=TOKEN_BUDGET)
        tb = await b.create_training_client(head=HEAD, token_budget=TOKEN_BUDGET)
        good = make_batch(1)
        # The caller gives up on a call that waits for the window of unanswered calls.
        window = [ta.forward_backward(good) for _ in range(MAX_UNANSWERED)]
        given_up = ta.forward_backward(good)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(given_up, 0.01)
        later = ta.optim_step()
        outputs = await asyncio.wait_for(asyncio.gather(*window, later), 120)
        assert [o.call for o in outputs] == [*range(MAX_UNANSWERED), MAX_UNANSWERED + 1]
        assert outputs[-1].metrics["step"] == 1

        # A call refused for its shape, in a round with another tenant's calls.
        wrong = VLABatch(good.images, good.instructions, good.proprio, good.actions[:, :3])
        beside = [tb.forward_backward(good) for _ in range(20)]
        loop = asyncio.get_running_loop()
        sent = loop.time()
        with pytest.raises(CallError, match=r"actions: expected float32 \(4, 4, 2\)"):
            await asyncio.wait_for(ta.forward_backward(wrong), 60)
        assert loop.time() - sent < 30  # a commit would be 300 s away
        await asyncio.wait_for(asyncio.gather(*beside), 60)

        # Within max_payload for the client's request, over it for the master's publish.
        limit = a.client.nc.max_payload
        near = padded_call(a.tenant, ta.session_id, ta.next_call, limit - 20)
        with pytest.raises(RequestError, match="over the server's max_payload") as refused:
            await a.client.request(a.tenant, near)
        assert refused.value.code == "invalid" and not refused.value.retryable
        # ... and one the client's own request would not fit is refused before it is sent.
        over = padded_call(a.tenant, ta.session_id, ta.next_call, limit + 1)
        with pytest.raises(RequestError, match="over the server's max_payload"):
            await a.client.request(a.tenant, over)
        # Everyone's connections are up: the master answers, the session goes on.
        assert (await asyncio.wait_for(tb.forward_backward(good), 60)).call == 20
        assert (await asyncio.wait_for(ta.forward_backward(good), 60)).call == ta.next_call - 1
        await ta.close()
        await tb.close()
    finally:
        await a.close()
        await b.close()


@pytest.mark.timeout(120)
async def test_a_session_not_open_in_time_is_closed_and_calls_past_max_calls_are_refused(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """A session waits, queued, behind its tenant's running jobs; the client that gave up on
    it closes it (else it would start later and hold a trainer slot for nobody until its
    lease ran out). And a call numbered past ``max_calls``, which the trainer would hold
    waiting for ever, is refused when it is queued."""
    tenant = uid("ll")
    record = TenantRecord(tenant, "U" + "A" * 55, time.time(), TenantLimits(1))
    nc = await connect(fresh_server.url)
    try:
        await declare(nc.jetstream())
        await (await nc.jetstream().key_value(subjects.KV_TENANTS)).put(tenant, encode(record))
    finally:
        await nc.close()
    procs.add(start_service("master", fresh_server.url, tmp_path / "master.log"))
    service = await ServiceClient.connect(fresh_server.url, tenant=tenant)
    try:
        spec = {"kind": "session", "tenant": tenant, "head": HEAD, "max_calls": 5}
        await service.client.submit(spec, job_id="capped")  # running: the one job allowed
        with pytest.raises(TimeoutError):
            await service.create_training_client(head=HEAD, session_id="waits", timeout=3.0)
        waited = await service.client.status(tenant, "waits")
        assert waited is not None and waited.status == "cancelled"
        assert waited.reason == "not open within 3s of its client's request"

        last = OptimStep(tenant, "capped", 4, 1e-3)
        await service.client.request(tenant, CallSession(tenant, "capped", last))
        past = OptimStep(tenant, "capped", 5, 1e-3)
        with pytest.raises(RequestError, match=r"call\.call: 5 is past the session's max_calls"):
            await service.client.request(tenant, CallSession(tenant, "capped", past))
    finally:
        await service.close()


@pytest.mark.timeout(120)
async def test_a_session_whose_tenant_is_revoked_fails_its_waiting_calls_at_once(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    """The client's event follower took the master's "unknown tenant" (not retryable) for a
    passing error and asked again every second for ever: calls waiting for an answer hung
    until a lease renewal found the tenant gone (a third of ``lease_s``, 100 s here)."""
    tenant = uid("ll")
    record = TenantRecord(tenant, "U" + "A" * 55, time.time(), TenantLimits(4))
    nc = await connect(fresh_server.url)
    await declare(nc.jetstream())
    tenants = await nc.jetstream().key_value(subjects.KV_TENANTS)
    await tenants.put(tenant, encode(record))
    procs.add(start_service("master", fresh_server.url, tmp_path / "master.log"))
    service = await ServiceClient.connect(fresh_server.url, tenant=tenant)
    try:
        training = await service.create_training_client(head=HEAD, lease_s=300.0)
        waiting = training.optim_step()  # no trainer runs: no answer comes
        queue = subjects.train("tiny", tenant)

        async def queued() -> bool:
            info = await nc.jetstream().stream_info(subjects.STREAM_TRAIN, subjects_filter=queue)
            return (info.state.subjects or {}).get(queue, 0) >= 2  # the OpenSlot and the call

        await eventually(queued, timeout=20, what="the call queued")
        await tenants.put(tenant, encode(msgspec.structs.replace(record, revoked=True)))
        with pytest.raises(SessionClosed, match=r"events unreadable: .*unknown tenant"):
            await asyncio.wait_for(waiting, 30)
    finally:
        await service.close()
        await nc.close()
