"""Exactly-once steps under trainer crashes: SIGKILL at random points (and between a
checkpoint's commit and its acks) never loses or repeats a step."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from nats.js import JetStreamContext

from bus.server import EmbeddedServer
from clients.sdk import Client
from tests.conftest import Procs
from tests.helpers import start_service, uid
from tests.sft_helpers import (
    DISCRETE_3D,
    FLOW_2D,
    final_policy,
    record_datasets,
    registered,
    sft_spec,
)

STEPS = 60


async def _progress(client: Client, tenant: str, job_id: str) -> int:
    record = await client.status(tenant, job_id)
    return record.policy_version if record else 0


@pytest.mark.timeout(600)
# With the slow ones: the default suite's chaos test (tests/test_chaos.py) SIGKILLs the trainer
# among the other roles and checks the same (steps once each, parameters equal).
@pytest.mark.slow
@pytest.mark.parametrize("lives", [4, 10])
async def test_a_trainer_sigkilled_again_and_again_ends_with_the_uninterrupted_parameters(
    lives: int, nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    data = record_datasets(tmp_path / "data")
    logs = tmp_path / "logs"
    logs.mkdir()
    procs.add(start_service("master", nats_server.url, logs / "master.log"))
    procs.add(start_service("envs", nats_server.url, logs / "envs.log"))

    def trainer(*args: str) -> subprocess.Popen[bytes]:
        return procs.add(
            start_service(
                "trainer",
                nats_server.url,
                logs / "trainer.log",
                "--deterministic",
                "--commit-every-s",
                "60",
                *args,
            )
        )

    async def specs(prefix: str) -> list[dict[str, object]]:
        a, b = uid(f"{prefix}a"), uid(f"{prefix}b")
        return [
            sft_spec(a, await registered(js, a, data["reach"]), FLOW_2D, STEPS, checkpoint_every=4),
            sft_spec(
                b, await registered(js, b, data["grasp"]), DISCRETE_3D, STEPS, checkpoint_every=3
            ),
        ]

    async with await Client.connect(nats_server.url) as client:
        # Reference: the same two jobs, uninterrupted.
        ref_trainer = trainer()
        ref_jobs = [await client.train_sft(s) for s in await specs("ref")]
        for job in ref_jobs:
            await job.wait(300)
        procs.stop(ref_trainer)

        jobs = [await client.train_sft(s) for s in await specs("crash")]
        rng = random.Random(1234)
        # How each trainer life ended: a kill counts only if a live trainer died of SIGKILL
        # (one that exited by itself, or was already gone when signalled, is no kill).
        deaths: list[int] = []
        for life in range(lives):
            if life % 2 == 0:
                # Dies by its own hand right after a commit, before acking what it covers.
                proc = trainer("--crash-after-commits", str(rng.randint(1, 3)))
                proc.wait(120)
            else:
                proc = trainer()
                await asyncio.sleep(rng.uniform(2.0, 5.0))  # start-up is ~2 s of it
                assert proc.poll() is None, (
                    f"life {life}: the trainer exited by itself ({proc.returncode}) before "
                    "the kill; see trainer.log"
                )
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
            deaths.append(proc.returncode)
            versions = [await _progress(client, j.tenant, j.job_id) for j in jobs]
            statuses = [(await client.status(j.tenant, j.job_id)) for j in jobs]
            assert all(s is not None and s.status != "succeeded" for s in statuses), (
                f"job finished before the end of life {life}; raise STEPS"
            )
            print(f"life {life}: exit {proc.returncode}, policy versions {versions}")
        assert deaths == [-signal.SIGKILL] * lives, (
            f"not {lives} SIGKILLs of a live trainer: {deaths}"
        )
        trainer()
        for job in jobs:
            result = await job.wait(300)
            assert result.status == "succeeded"

        for ref, job in zip(ref_jobs, jobs, strict=True):
            ref_rec, ref_params = await final_policy(js, ref.tenant, ref.job_id)
            rec, params = await final_policy(js, job.tenant, job.job_id)
            assert rec.step == ref_rec.step == STEPS, "a step was lost or applied twice"
            assert rec.batches_done == STEPS
            for name, value in ref_params.items():
                assert torch.equal(params[name], value), f"{job.tenant}: {name} differs"
