"""Recovery by replay for an env worker: SIGKILLed while it streams an SFT job's dataset, the
restarted worker resumes the stream at the job's committed progress (its task is redelivered
from ``ENV``), the trainer drops nothing and applies no batch twice, and the job ends with
the per-step losses and final parameters of a run without the fault."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
import torch

from bus.declare import declare
from bus.server import EmbeddedServer
from clients.sdk import Client
from schemas.events import PolicyPublished, Progress
from tests.conftest import Procs
from tests.helpers import start_service, uid
from tests.sft_helpers import final_policy, record_datasets, registered, sft_spec

HEAD = {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4}
STEPS = 40


# With the slow ones: the default suite's chaos test SIGKILLs env workers mid-stream too.
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_an_env_worker_sigkilled_mid_stream_resumes_with_the_fault_free_result(
    fresh_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    client = await Client.connect(fresh_server.url)
    await declare(client.js)
    logs = tmp_path / "logs"
    logs.mkdir()
    # A short task ack wait: the killed worker's stream task goes to the new one sooner.
    fast = ("--ack-wait-s", "3")
    procs.add(start_service("master", fresh_server.url, logs / "master.log"))
    procs.add(start_service("trainer", fresh_server.url, logs / "trainer.log", "--deterministic"))
    envs = procs.add(start_service("envs", fresh_server.url, logs / "envs.log", *fast))
    data = record_datasets(tmp_path / "data")
    try:
        clean, faulty = uid("clean"), uid("faulty")
        for tenant in (clean, faulty):
            await registered(client.js, tenant, data["reach"])
        reference = await client.train_sft(sft_spec(clean, "reach", HEAD, STEPS))
        ref_losses: dict[int, float] = {}
        async for event in reference.events(idle_timeout=120):
            if isinstance(event, Progress):
                ref_losses[event.step] = event.metrics["loss"]

        job = await client.train_sft(sft_spec(faulty, "reach", HEAD, STEPS))
        losses: dict[int, float] = {}
        steps_seen: list[int] = []
        killed = False
        async for event in job.events(idle_timeout=120):
            if isinstance(event, Progress):
                steps_seen.append(event.step)
                losses[event.step] = event.metrics["loss"]
                if not killed and event.step >= 8:
                    # Mid-stream: batches published ahead of the trainer, others not yet.
                    envs.send_signal(signal.SIGKILL)
                    envs.wait(10)
                    killed = True
                    procs.add(start_service("envs", fresh_server.url, logs / "envs2.log", *fast))
            elif isinstance(event, PolicyPublished) and event.final:
                break
        assert killed
        record = await asyncio.wait_for(job.wait(), 120)
        assert record.status == "succeeded"
        # Every step once, in order, each with the loss of the run without the fault.
        assert sorted(losses) == list(range(1, STEPS + 1))
        assert len(steps_seen) == len(set(steps_seen))
        assert losses == {s: ref_losses[s] for s in losses}
        (_, clean_params), (_, faulty_params) = [
            await final_policy(client.js, t, j.job_id)
            for t, j in ((clean, reference), (faulty, job))
        ]
        for name, value in clean_params.items():
            assert torch.equal(value, faulty_params[name]), name
    finally:
        await client.close()
