"""Unequal priorities over the bus: three tenants' SFT jobs at priority 1, 2 and 4 on one
trainer are served in proportion to their priorities (DRR credit decides, not the cap of one
batch per tenant per round), while all three are running."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from bus.declare import declare
from bus.server import EmbeddedServer
from clients.sdk import Client, Job
from schemas.events import Progress
from tests.conftest import Procs
from tests.helpers import uid
from tests.sft_helpers import record_datasets, registered, sft_spec, start_stack

HEAD = {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4}
PRIORITIES = (1, 2, 4)


@pytest.mark.stack
@pytest.mark.timeout(240)
async def test_tenants_at_priorities_1_2_4_get_steps_in_proportion(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    client = await Client.connect(fresh_server.url)
    await declare(client.js)
    start_stack(fresh_server.url, tmp_path / "logs", procs)
    data = record_datasets(tmp_path / "data")
    try:
        tenants = [uid(f"p{p}") for p in PRIORITIES]
        for t in tenants:
            await registered(client.js, t, data["reach"])
        steps = 80
        jobs = [
            await client.train_sft(sft_spec(t, "reach", HEAD, steps, priority=p, batch_size=8))
            for t, p in zip(tenants, PRIORITIES, strict=True)
        ]
        times: dict[str, list[float]] = {t: [] for t in tenants}

        async def follow(tenant: str, job: Job) -> None:
            async for event in job.events(idle_timeout=120):
                if isinstance(event, Progress):
                    times[tenant].append(time.monotonic())

        await asyncio.wait_for(
            asyncio.gather(*(follow(t, j) for t, j in zip(tenants, jobs, strict=True))), 200
        )
        # The window in which all three ran: from the last one's first step to the first
        # one's last step (the priority-4 tenant ends first).
        start = max(ts[0] for ts in times.values())
        end = min(ts[-1] for ts in times.values())
        assert end - start > 0.5, (start, end)
        served = [sum(start <= x <= end for x in times[t]) for t in tenants]
        print("steps in the shared window by priority 1/2/4:", served)
        assert served[1] / served[0] == pytest.approx(2.0, rel=0.3), served
        assert served[2] / served[0] == pytest.approx(4.0, rel=0.3), served
    finally:
        await client.close()
