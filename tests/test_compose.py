"""`docker compose up` for real: the images built the offline way (scripts/compose-images.sh),
the stack of compose.yaml started, an SFT job submitted from the host with the SDK as a
tenant, a role's process killed and restarted by the restart policy, the job finished; and
the cluster profile's three NATS nodes forming one JetStream cluster, a tenant's bucket on it
replicated three times.

Marker ``compose`` (``make test-compose``; .ci/run runs it last, after
scripts/docker-engine.sh has made an engine reachable). Everything runs under a compose
project of its own (uuid name, its own network and volumes, removed with ``down -v``); the
test talks to loopback (published ports) and to its own containers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from nats.errors import Error as NatsError

from bus.connect import connect
from bus.declare import BusLayout, declare
from bus.server import free_port
from clients.sdk import Client
from schemas import subjects
from schemas.events import Progress
from services.envs.datasets import record
from services.envs.sims import REACH2D_ID
from tests.helpers import ROOT, eventually, joynexus, uid

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1200)]

IMAGES = {
    "JOYNEXUS_BASE_IMAGE": "joynexus/debian:bookworm",
    "NATS_IMAGE": "joynexus/nats:local",
    "JOYNEXUS_IMAGE": "joynexus:local",
}
#: Long enough on this machine (~25 ms a step) that the trainer dies mid-job.
STEPS = 1500
ROLES = ("master", "trainer", "inferencer", "envs", "health")


def compose_command() -> list[str]:
    """``docker compose`` (v2 plugin) where it exists, else ``docker-compose`` (v1)."""
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    if v2.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose") is None:
        pytest.fail("neither `docker compose` nor `docker-compose`: run scripts/docker-engine.sh")
    return ["docker-compose"]


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """Build (or find up to date: the build is cached) the images, the offline way."""
    if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        pytest.fail("no Docker engine answers: run scripts/docker-engine.sh first")
    venv = Path(sys.executable).parent.parent
    built = subprocess.run(
        ["bash", "scripts/compose-images.sh", str(venv)],
        cwd=ROOT,
        env={**os.environ, **IMAGES},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return IMAGES


@dataclass
class Project:
    """One compose project of this test: its name, home (identities) and host ports."""

    name: str
    home: Path
    nats_port: int
    env: dict[str, str]
    compose: list[str]

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*self.compose, "-p", self.name, *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert done.returncode == 0, f"compose {' '.join(args)}:\n{done.stdout}{done.stderr}"
        return done

    def container(self, service: str) -> str:
        ids = self.run("ps", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def containers(self) -> list[str]:
        return self.run("ps", "-q").stdout.split()


def docker_inspect(container: str) -> dict[str, Any]:
    """``docker inspect``'s record of one container (State, RestartCount, NetworkSettings)."""
    out = subprocess.run(
        ["docker", "inspect", container], capture_output=True, text=True, check=True
    )
    record: dict[str, Any] = json.loads(out.stdout)[0]
    return record


def health(container: str) -> str:
    return str(docker_inspect(container)["State"].get("Health", {}).get("Status", "none"))


@pytest.fixture
def project(images: dict[str, str], tmp_path: Path) -> Iterator[Project]:
    home = tmp_path / "home"
    for directory in ("datasets", "models"):
        (tmp_path / directory).mkdir()
    nats_port = free_port()
    env = {
        **os.environ,
        **images,
        "JOYNEXUS_DEPLOY_HOME": str(home),
        "JOYNEXUS_NATS_PORT": f"127.0.0.1:{nats_port}",
        "JOYNEXUS_NATS_MONITOR_PORT": f"127.0.0.1:{free_port()}",
        "JOYNEXUS_DATASETS": str(tmp_path / "datasets"),
        "JOYNEXUS_MODELS": str(tmp_path / "models"),
    }
    project = Project(uid("jnx"), home, nats_port, env, compose_command())
    try:
        yield project
    finally:
        logs = subprocess.run(
            [*project.compose, "-p", project.name, "logs", "--no-color", "--tail", "60"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        print(logs.stdout[-20000:])
        subprocess.run(
            [*project.compose, "-p", project.name, "down", "-v", "--timeout", "5"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            timeout=180,
            check=False,
        )


async def test_compose_stack_trains_sft_and_restarts_a_killed_role(
    project: Project, tmp_path: Path
) -> None:
    init = await joynexus("tenant", "init", "--home", str(project.home))
    assert init.returncode == 0, init.stderr
    await asyncio.to_thread(project.run, "up", "-d", "--no-build", "--scale", "envs=2")

    containers = project.containers()
    assert len(containers) == len(ROLES) + 2  # nats, and two env workers

    async def all_healthy() -> bool:
        states = await asyncio.to_thread(lambda: [health(c) for c in containers])
        return all(s == "healthy" for s in states)

    up_at = time.monotonic()
    await eventually(all_healthy, timeout=240, interval=2, what="every container healthy")
    print(f"compose: {len(containers)} containers healthy in {time.monotonic() - up_at:.1f} s")

    tenant = uid("acme")
    added = await joynexus(
        "tenant", "add", tenant, "--home", str(project.home), "--url", project.url
    )
    assert added.returncode == 0, added.stdout + added.stderr
    project.run("kill", "-s", "HUP", "nats")
    creds = project.home / "creds" / f"{tenant}.creds"

    async def tenant_connects() -> Client | None:
        try:
            return await Client.connect(project.url, creds=creds)
        except (NatsError, OSError):  # the reload is applied asynchronously: retried
            return None

    client = await eventually(tenant_connects, timeout=30, interval=0.5, what="tenant accepted")
    try:
        dataset = tmp_path / "reach"
        await asyncio.to_thread(record, REACH2D_ID, 16, dataset, seed=0)
        await client.push_dataset(tenant, dataset, "reach")
        job = await client.train_sft(
            {
                "kind": "sft",
                "tenant": tenant,
                "dataset": "reach",
                "head": {"kind": "oft", "action_dim": 2, "chunk_len": 4, "proprio_dim": 4},
                "steps": STEPS,
                "batch_size": 8,
                "seed": 7,
                "checkpoint_every": 5,
                "optimizer": {"lr": 3e-3},
            }
        )

        async def step_reached(step: int) -> bool:
            async for event in job.events(idle_timeout=120):
                if isinstance(event, Progress) and event.step >= step:
                    return True
            return False

        assert await asyncio.wait_for(step_reached(10), 300), "the job ended before step 10"

        trainer = project.container("trainer")
        before = docker_inspect(trainer)
        # SIGKILL from the host to the container's process: a crash, not `docker kill`
        # (which compose's restart policy counts as a manual stop and leaves stopped).
        os.kill(int(before["State"]["Pid"]), signal.SIGKILL)
        killed_at = time.monotonic()
        job_record = await client.status(tenant, job.job_id)
        assert job_record is not None and job_record.status == "running", "killed too late"

        def restarted() -> bool:
            after = docker_inspect(trainer)
            return bool(
                after["RestartCount"] > before["RestartCount"]
                and after["State"]["Running"]
                and after["State"]["Pid"] != before["State"]["Pid"]
            )

        await eventually(
            lambda: asyncio.to_thread(restarted),
            timeout=60,
            interval=0.5,
            what="the restart policy restarting the trainer",
        )
        print(f"compose: trainer restarted {time.monotonic() - killed_at:.1f} s after the kill")
        result = await job.wait(timeout=600)
        print(f"compose: job succeeded {time.monotonic() - killed_at:.1f} s after the kill")
        assert result.status == "succeeded" and result.policy_version >= 1
        assert result.metrics, "the finished job reports its last metrics"
        steps = [e.step async for e in job.events() if isinstance(e, Progress)]
        assert max(steps) >= STEPS - 1, f"the job trained to step {max(steps)} of {STEPS}"
        await eventually(
            lambda: asyncio.to_thread(lambda: health(trainer) == "healthy"),
            timeout=120,
            interval=2,
            what="the restarted trainer healthy again",
        )
    finally:
        await client.close()


async def test_cluster_profile_forms_one_jetstream_cluster(project: Project) -> None:
    init = await joynexus("tenant", "init", "--home", str(project.home))
    assert init.returncode == 0, init.stderr
    nodes = ("nats-1", "nats-2", "nats-3")
    await asyncio.to_thread(project.run, "--profile", "cluster", "up", "-d", "--no-build", *nodes)
    containers = [project.container(node) for node in nodes]

    def address(container: str) -> str:
        networks = docker_inspect(container)["NetworkSettings"]["Networks"]
        return str(next(iter(networks.values()))["IPAddress"])

    url = ",".join(f"nats://{address(c)}:4222" for c in containers)
    await eventually(
        lambda: asyncio.to_thread(lambda: all(health(c) == "healthy" for c in containers)),
        timeout=120,
        interval=1,
        what="three healthy nodes",
    )

    async def declared() -> bool:
        nc = await connect(url, creds=project.home / "creds" / "service.creds")
        try:
            js = nc.jetstream()
            with contextlib.suppress(NatsError, TimeoutError):  # no meta leader yet: retried
                await declare(js, BusLayout(replicas=3))
                info = await js.stream_info(subjects.STREAM_TRAIN)
                cluster = info.cluster
                return bool(
                    cluster is not None
                    and cluster.leader
                    and len(cluster.replicas or []) == 2
                    and all(r.current for r in cluster.replicas or [])
                )
            return False
        finally:
            await nc.close()

    await eventually(declared, timeout=90, interval=2, what="an R3 stream with a leader")

    tenant = uid("acme")
    added = await joynexus(
        "tenant", "add", tenant, "--home", str(project.home), "--url", url, "--replicas", "3"
    )
    assert added.returncode == 0, added.stdout + added.stderr
    nc = await connect(url, creds=project.home / "creds" / "service.creds")
    try:
        bucket = await nc.jetstream().stream_info(f"OBJ_data-{tenant}")
        assert bucket.config.num_replicas == 3
    finally:
        await nc.close()
