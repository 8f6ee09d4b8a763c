"""Broker faults: the NATS server SIGKILLed mid-workload and started again on the same store.
Every service reconnects and resumes on its own (no role is restarted), nothing the bus
acknowledged is lost, and the job ends with the per-step losses and final parameters of a
run without the fault."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from bus.declare import declare
from bus.server import EmbeddedServer
from clients.sdk import Client, Job
from schemas.events import Progress
from tests.conftest import Procs
from tests.helpers import uid
from tests.sft_helpers import (
    OFT_2D,
    final_policy,
    record_datasets,
    registered,
    sft_spec,
    start_stack,
    stored_losses,
)

STEPS = 30


@pytest.mark.timeout(300)
@pytest.mark.stack
async def test_a_broker_sigkilled_mid_job_loses_nothing(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    data = record_datasets(tmp_path / "data")
    roles = start_stack(fresh_server.url, tmp_path / "logs", procs)
    client = await Client.connect(fresh_server.url)
    try:
        await declare(client.js)
        clean, faulty = uid("clean"), uid("faulty")
        for tenant in (clean, faulty):
            await registered(client.js, tenant, data["reach"])
        reference = await client.train_sft(sft_spec(clean, "reach", OFT_2D, STEPS))
        assert (await asyncio.wait_for(reference.wait(), 180)).status == "succeeded"

        job = await client.train_sft(sft_spec(faulty, "reach", OFT_2D, STEPS))
        killed_at = 0.0
        async for event in job.events(idle_timeout=120):
            if isinstance(event, Progress) and event.step >= 8 and not killed_at:
                # Mid-job: batches streamed ahead of the trainer, steps committed and not.
                running = await client.status(faulty, job.job_id)
                assert running is not None and running.status == "running"
                fresh_server.kill()
                killed_at = time.monotonic()
                await asyncio.sleep(1.0)  # the services see the broker gone and keep trying
                await asyncio.to_thread(fresh_server.restart)
        assert killed_at
        assert (await asyncio.wait_for(job.wait(), 180)).status == "succeeded"
        assert all(p.poll() is None for p in roles.values()), "a role died with the broker"
        ref_losses = await stored_losses(Job(client, clean, reference.job_id))
        losses = await stored_losses(job)
        # Every step applied once (the last commit's count, and the parameters below); each
        # reported loss is the fault-free run's. A progress event the broker could not take
        # while it was away is skipped by design (the next carries the job on).
        assert set(losses) <= set(range(1, STEPS + 1)) and len(losses) >= STEPS - 3, losses
        assert losses == {s: ref_losses[s] for s in losses}
        (_, ref_params), (record, params) = [
            await final_policy(client.js, t, j.job_id)
            for t, j in ((clean, reference), (faulty, job))
        ]
        assert record.batches_done == STEPS
        for name, value in ref_params.items():
            assert torch.equal(value, params[name]), name
    finally:
        await client.close()
