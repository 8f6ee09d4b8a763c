"""Many small tenants at once on one stack (issue 11, part 4): 50 tenants each submit a short
SFT job at the same moment; every job succeeds and the trainer's fair share holds: Jain's
index of the tenants' training throughput (steps per second while running) is at least 0.9
at equal priority. Real roles as subprocesses; the jobs are followed through the master.
About 20 s on this machine, so it runs in the default suite."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from bus.server import EmbeddedServer
from clients.sdk import Client, Job
from schemas.events import StateChanged
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID
from tests.conftest import Procs
from tests.helpers import uid
from tests.sft_helpers import OFT_2D, registered, sft_spec, start_stack

TENANTS = 50
STEPS = 6


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one gets everything."""
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


async def running_span(job: Job) -> tuple[float, float, str]:
    """(running at, ended at, final status) from the job's state events."""
    started = ended = 0.0
    status = ""
    async for event in job.events(idle_timeout=300):
        if isinstance(event, StateChanged):
            if event.status == "running" and not started:
                started = event.at
            status, ended = event.status, event.at
    return started, ended, status


@pytest.mark.timeout(300)
async def test_fifty_tenants_submitted_at_once_all_finish_with_a_fair_share(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    start_stack(nats_server.url, tmp_path / "logs", procs)
    record(REACH2D_ID, 8, tmp_path / "reach", seed=0)
    tenants = [uid(f"t{i:02d}") for i in range(TENANTS)]
    specs = [
        sft_spec(t, await registered(js, t, tmp_path / "reach"), OFT_2D, STEPS, batch_size=4)
        for t in tenants
    ]
    async with await Client.connect(nats_server.url) as client:
        t0 = time.monotonic()
        jobs = await asyncio.gather(*(client.train_sft(s) for s in specs))
        spans = await asyncio.gather(*(running_span(j) for j in jobs))
        wall_s = time.monotonic() - t0
    statuses = [status for _, _, status in spans]
    assert statuses == ["succeeded"] * TENANTS, statuses
    throughput = [STEPS / max(1e-3, end - start) for start, end, _ in spans]
    index = jain(throughput)
    print(
        f"{TENANTS} tenants x {STEPS} steps: all succeeded in {wall_s:.1f}s; "
        f"Jain's index of steps/s while running {index:.3f} "
        f"(min {min(throughput):.2f}, max {max(throughput):.2f} steps/s)"
    )
    assert index >= 0.9


def test_jain_index() -> None:
    assert jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
