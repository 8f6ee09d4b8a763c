"""A 3-node JetStream cluster for the local stack (``joynexus up --cluster 3``): every stream,
KV bucket and object store at 3 replicas; SIGKILL of the node leading the Training Queue in
the middle of a job loses nothing (the job ends with the fault-free run's per-step losses
and parameters, no role dies) and the node, started again, rejoins and catches up."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from nats.js import JetStreamContext

from clients.sdk import Client, Job
from schemas import subjects
from schemas.events import Progress
from services.launcher import LocalStack
from tests.helpers import eventually, print_log_tails, uid
from tests.sft_helpers import (
    OFT_2D,
    final_policy,
    record_datasets,
    registered,
    sft_spec,
    stored_losses,
)

STEPS = 30


async def replicas_of(js: JetStreamContext, stream: str) -> tuple[int, str, list[bool]]:
    """The stream's replica count, its leader's name, and whether each follower is current."""
    info = await js.stream_info(stream)
    cluster = info.cluster
    assert cluster is not None
    followers = [bool(r.current) for r in (cluster.replicas or [])]
    return info.config.num_replicas or 1, cluster.leader or "", followers


@pytest.mark.timeout(300)
@pytest.mark.stack
def test_a_cluster_node_sigkilled_mid_job_loses_nothing_and_rejoins(tmp_path: Path) -> None:
    data = record_datasets(tmp_path / "data")
    stack = LocalStack(
        tmp_path / "home",
        roles={"master": 1, "trainer": 1, "envs": 1},
        auth=False,
        tenants=(),
        cluster=3,
        role_args={"trainer": ["--deterministic"]},
    )
    try:
        info = stack.start_server()
        stack.start_roles()
        asyncio.run(drive(stack, info.url, info.user, info.password, data["reach"]))
        assert all(c.proc is not None and c.proc.poll() is None for c in stack.children)
        assert all(c.restarts == 0 for c in stack.children)
    except BaseException:
        print_log_tails(tmp_path / "home")
        raise
    finally:
        stack.stop()


async def drive(stack: LocalStack, url: str, user: str, password: str, dataset: Path) -> None:
    assert stack.nodes is not None
    client = await Client.connect(url, user=user, password=password)
    try:
        js = client.js
        for stream in (subjects.STREAM_TRAIN, subjects.STREAM_JOBS, subjects.STREAM_EVENTS):
            assert (await replicas_of(js, stream))[0] == 3, stream
        kv = await js.key_value(subjects.KV_JOBS)
        assert (await kv.status()).stream_info.config.num_replicas == 3
        clean, faulty = uid("clean"), uid("faulty")
        for tenant in (clean, faulty):
            await registered(js, tenant, dataset)
        reference = await client.train_sft(sft_spec(clean, "reach", OFT_2D, STEPS))
        assert (await asyncio.wait_for(reference.wait(), 180)).status == "succeeded"

        job = await client.train_sft(sft_spec(faulty, "reach", OFT_2D, STEPS))
        killed = -1
        async for event in job.events(idle_timeout=120):
            if isinstance(event, Progress) and event.step >= 8 and killed < 0:
                running = await client.status(faulty, job.job_id)
                assert running is not None and running.status == "running"
                _, leader, _ = await replicas_of(js, subjects.STREAM_TRAIN)
                killed = int(leader.rsplit("-", 1)[1]) - 1  # "node-2" → 1
                stack.nodes.kill(killed)
        assert killed >= 0
        assert (await asyncio.wait_for(job.wait(), 180)).status == "succeeded"
        losses, ref_losses = (
            await stored_losses(job),
            await stored_losses(Job(client, clean, reference.job_id)),
        )
        # Every step applied once (the last commit's count, and the parameters below); each
        # reported loss is the fault-free run's. A progress event the broker could not take
        # while it was away is skipped by design (the next carries the job on).
        assert set(losses) <= set(range(1, STEPS + 1)) and len(losses) >= STEPS - 3, losses
        assert losses == {s: ref_losses[s] for s in losses}
        (_, ref_params), (record, params) = [
            await final_policy(js, t, j.job_id) for t, j in ((clean, reference), (faulty, job))
        ]
        assert record.batches_done == STEPS
        for name, value in ref_params.items():
            assert torch.equal(value, params[name]), name

        # Started again on its store, the node rejoins: every replica of the queue current.
        await asyncio.to_thread(stack.nodes.restart, killed)
        t0 = time.monotonic()

        async def caught_up() -> bool | None:
            try:
                count, _, followers = await replicas_of(js, subjects.STREAM_TRAIN)
            except Exception:  # noqa: BLE001 - the cluster is re-forming: asked again
                return None
            return (len(followers) == count - 1 and all(followers)) or None

        await eventually(caught_up, timeout=60, what="the restarted node caught up")
        assert time.monotonic() - t0 < 60
    finally:
        await client.close()
