"""Many small tenants at once on one stack (issue 11, part 4): 50 tenants each submit a short
SFT job at the same moment; every job succeeds and the trainer's fair share holds: Jain's
index of the tenants' training throughput (steps per second while running) is at least 0.9
at equal priority. Once they are done, their 50 durables stay bound to the trainer, idle: a
probe job's rounds fetch no more than the same job's on a restarted trainer, which binds no
idle tenant (no per-round fetch for idle consumers), and its steps/s is measured against
that one's. Real roles as subprocesses; the jobs are followed through the master. About
30 s on this machine, so it runs in the default suite."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from bus.codec import decode
from bus.kv import kv_values
from bus.server import EmbeddedServer
from clients.sdk import Client, Job
from schemas import subjects
from schemas.events import Progress, StateChanged
from schemas.health import HEARTBEAT_DECODER
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID
from tests.conftest import Procs
from tests.helpers import eventually, start_service, uid
from tests.sft_helpers import OFT_2D, registered, sft_spec, start_stack

TENANTS = 50
STEPS = 6
PROBE_STEPS = 24


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


async def trainer_gauges(js: JetStreamContext, after: float) -> dict[str, float]:
    """The trainer's gauges from a heartbeat written after ``after`` (wall time)."""

    async def fresh() -> dict[str, float] | None:
        for value in (await kv_values(js, subjects.KV_HEARTBEATS, "trainer.")).values():
            beat = decode(HEARTBEAT_DECODER, value)
            if beat.at > after:
                return dict(beat.gauges)
        return None

    return await eventually(fresh, timeout=60, what="a fresh trainer heartbeat")


async def probe(client: Client, js: JetStreamContext, spec: dict[str, object]) -> dict[str, float]:
    """Run one SFT job alone; its steps/s (first to last progress) and the trainer's fetch
    requests per grouped step meanwhile."""
    before = await trainer_gauges(js, time.time())  # also: the trainer is up
    job = await client.train_sft(spec)
    times = [e.at async for e in job.events(idle_timeout=120) if isinstance(e, Progress)]
    after = await trainer_gauges(js, time.time())
    rounds = after["sft_step_n"] - before["sft_step_n"]
    return {
        "steps_per_s": (len(times) - 1) / (times[-1] - times[0]),
        "fetches_per_round": (after["fetches"] - before["fetches"]) / rounds,
        "tenants": after["tenants"],
    }


@pytest.mark.timeout(300)
@pytest.mark.stack
async def test_fifty_tenants_submitted_at_once_all_finish_with_a_fair_share(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    stack = start_stack(nats_server.url, tmp_path / "logs", procs)
    record(REACH2D_ID, 8, tmp_path / "reach", seed=0)
    prober = uid("probe")
    probe_spec = sft_spec(
        prober, await registered(js, prober, tmp_path / "reach"), OFT_2D, PROBE_STEPS
    )
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
        beside_idle = await probe(client, js, probe_spec)
        # A restarted trainer binds only tenants with messages in TRAIN: none is idle.
        assert procs.stop(stack["trainer"]) == 0
        logs = tmp_path / "logs"
        procs.add(start_service("trainer", nats_server.url, logs / "t2.log", "--deterministic"))
        alone = await probe(client, js, {**probe_spec, "seed": 8})
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
    print(
        f"a probe job alone: {alone['steps_per_s']:.1f} steps/s, "
        f"{alone['fetches_per_round']:.2f} fetches per round; beside "
        f"{beside_idle['tenants']:.0f} bound tenants ({TENANTS} idle): "
        f"{beside_idle['steps_per_s']:.1f} steps/s, "
        f"{beside_idle['fetches_per_round']:.2f} fetches per round"
    )
    assert beside_idle["tenants"] >= TENANTS + 1  # their durables are still bound
    assert alone["tenants"] <= 2  # the prober's (and none of the 50)
    # Idle tenants cost no fetch: rounds ask the broker as often as with none bound.
    assert beside_idle["fetches_per_round"] <= alone["fetches_per_round"] + 0.5
    # A generous bound (the machine is shared): 50 fetches a round would cost several times.
    assert beside_idle["steps_per_s"] >= 0.5 * alone["steps_per_s"]


def test_jain_index() -> None:
    assert jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
