"""Recovery by replay for the master: its state is the ``jobs`` KV and what it rebuilds from
it. SIGKILLed and started again, it answers with the same state, byte for byte (queued jobs,
open sessions' leases, every record), and carries on: the queued jobs are started and end as
they would have; a burst of submits cut by a second SIGKILL loses and repeats none."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from bus.codec import decode, encode
from bus.declare import declare
from bus.server import EmbeddedServer
from clients.sdk import Client, Job
from schemas import subjects
from schemas.events import StateChanged
from schemas.masterstate import MASTER_STATE_DECODER, MASTER_STATE_SUBJECT, MasterState
from schemas.tenants import TenantLimits, TenantRecord
from tests.conftest import Procs
from tests.helpers import eventually, start_service, uid
from tests.sft_helpers import OFT_2D, record_datasets, registered, sft_spec

STEPS = 6


async def state_bytes(client: Client) -> bytes | None:
    try:
        return bytes((await client.nc.request(MASTER_STATE_SUBJECT, b"", timeout=2)).data)
    except Exception:  # noqa: BLE001 - no master answering yet: asked again
        return None


async def settled_state(client: Client, check: object) -> tuple[bytes, MasterState]:
    """The master's state once ``check`` holds for it and two reads in a row agree."""

    async def read() -> tuple[bytes, MasterState] | None:
        first, second = await state_bytes(client), await state_bytes(client)
        if first is None or first != second:
            return None
        state = decode(MASTER_STATE_DECODER, first)
        return (first, state) if check(state) else None  # type: ignore[operator]

    return await eventually(read, timeout=60, what="the master's state settled")


@pytest.mark.timeout(300)
@pytest.mark.stack
async def test_a_restarted_master_rebuilds_the_same_state_and_carries_on(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    data = record_datasets(tmp_path / "data")
    master = procs.add(start_service("master", fresh_server.url, logs / "master-1.log"))
    client = await Client.connect(fresh_server.url)
    try:
        await declare(client.js)
        alice, bob = uid("alice"), uid("bob")
        tenants = await client.js.key_value(subjects.KV_TENANTS)
        now = time.time()
        # Alice may run one job at a time: her others queue behind it.
        await tenants.put(alice, encode(TenantRecord(alice, "U" + "A" * 55, now, TenantLimits(1))))
        await tenants.put(bob, encode(TenantRecord(bob, "U" + "B" * 55, now)))
        for tenant in (alice, bob):
            await registered(client.js, tenant, data["reach"])
        jobs = [await client.train_sft(sft_spec(alice, "reach", OFT_2D, STEPS)) for _ in range(4)]
        await client.cancel(alice, jobs[3].job_id, "changed my mind")
        session = await client.submit(
            {"kind": "session", "tenant": bob, "head": OFT_2D, "lease_s": 600}
        )
        # A job the master refuses (no such dataset) is part of the table too.
        refused = await client.train_sft(sft_spec(bob, "no-such-data", OFT_2D, STEPS))

        def everything_recorded(state: MasterState) -> bool:
            statuses = {r.job_id: r.status for r in state.jobs}
            return (
                statuses.get(jobs[3].job_id) == "cancelled"
                and statuses.get(session.job_id) is not None
                and refused.job_id not in statuses  # refused: no record, a dead letter
                and len(state.queued) == 2
                and len(state.sessions) == 1
            )

        before, state = await settled_state(client, everything_recorded)
        assert [q.job_id for q in state.queued] == sorted(j.job_id for j in jobs[1:3])
        assert state.sessions[0].lease_s == 600

        master.send_signal(signal.SIGKILL)
        master.wait(10)
        assert await state_bytes(client) is None  # nobody answers: the state is not cached
        master = procs.add(start_service("master", fresh_server.url, logs / "master-2.log"))
        after, _ = await settled_state(client, everything_recorded)
        assert after == before

        # It carries on: with a trainer and an env worker the queued jobs run, one at a time.
        procs.add(start_service("trainer", fresh_server.url, logs / "trainer.log"))
        procs.add(start_service("envs", fresh_server.url, logs / "envs.log"))
        for job in jobs[:3]:
            assert (await asyncio.wait_for(job.wait(), 120)).status == "succeeded"

        # A burst of submits cut by a SIGKILL: each accepted submit runs once.
        burst = [
            await client.train_sft(sft_spec(bob, "reach", OFT_2D, STEPS), job_id=f"burst-{i}")
            for i in range(2)
        ]
        master.send_signal(signal.SIGKILL)
        master.wait(10)
        procs.add(start_service("master", fresh_server.url, logs / "master-3.log"))
        for job in burst:
            assert (await asyncio.wait_for(job.wait(), 120)).status == "succeeded"
            assert await _starts(client, job) == 1
        await client.cancel(bob, session.job_id)
    finally:
        await client.close()


async def _starts(client: Client, job: Job) -> int:
    """How many times the job was set running (a replayed submit must not start it again)."""
    count = 0
    async for event in job.events(idle_timeout=10):
        if isinstance(event, StateChanged) and event.status == "running":
            count += 1
    return count
