"""Each role as a real subprocess: heartbeats, clean SIGTERM stop, master behaviour, health
report, config errors, `joynexus up --check`, and no accepted job lost to a broker crash."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import msgspec
import pytest
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from bus.codec import decode, encode
from bus.connect import connect
from bus.datasets import register_path
from bus.declare import declare
from bus.kv import kv_values
from bus.server import EmbeddedServer, free_port
from clients.sdk import Client, JobFailed
from schemas import headers, subjects
from schemas.health import (
    HEALTH_REPORT_DECODER,
    HEALTH_SUBJECT,
    HEARTBEAT_DECODER,
    ROLES,
    HealthReport,
)
from schemas.jobs import JobRecord, JobSubmit
from schemas.specs import JobSpecError
from tests.conftest import Procs
from tests.helpers import ROOT, eventually, start_service, uid


async def _heartbeat(js: JetStreamContext, role: str, pid: int) -> bool:
    for key, value in (await kv_values(js, subjects.KV_HEARTBEATS)).items():
        if decode(HEARTBEAT_DECODER, value).pid == pid:
            return key.startswith(role + ".")
    return False


@pytest.mark.parametrize("role", ROLES)
async def test_role_entry_point_heartbeats_and_stops_cleanly(
    role: str, nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> None:
    proc = procs.add(start_service(role, nats_server.url, tmp_path / f"{role}.log"))
    await eventually(lambda: _heartbeat(js, role, proc.pid), timeout=30, what=f"{role} heartbeat")
    assert procs.stop(proc) == 0, (tmp_path / f"{role}.log").read_text()[-2000:]
    assert not await _heartbeat(js, role, proc.pid), "clean stop deletes the heartbeat"


#: A real (tiny) dataset: the master validates the dataset of every SFT job at submit.
DATASET = Path()


@pytest.fixture(scope="module", autouse=True)
def _dataset(tmp_path_factory: pytest.TempPathFactory) -> None:
    from services.envs.datasets import record

    global DATASET
    DATASET = tmp_path_factory.mktemp("ds") / "reach"
    record("JoyNexus/Reach2D-v0", 2, DATASET, seed=0)


async def _register(client: Client, tenant: str) -> None:
    """Put :data:`DATASET` into ``tenant``'s namespace as ``reach`` (the operator's way)."""
    await register_path(client.js, tenant, "reach", DATASET)


def _sft_spec(tenant: str, **overrides: object) -> dict[str, object]:
    spec: dict[str, object] = {
        "kind": "sft",
        "tenant": tenant,
        "dataset": "reach",  # registered in each test's tenant namespace (_register)
        "steps": 5,
        "head": {"kind": "oft", "action_dim": 2, "chunk_len": 4},
    }
    spec.update(overrides)
    return spec


@pytest.fixture
def master(
    nats_server: EmbeddedServer, js: JetStreamContext, procs: Procs, tmp_path: Path
) -> subprocess.Popen[bytes]:
    return procs.add(start_service("master", nats_server.url, tmp_path / "master.log"))


async def test_master_accepts_valid_job_and_records_it(
    master: subprocess.Popen[bytes], nats_server: EmbeddedServer
) -> None:
    tenant = uid("acme")
    async with await Client.connect(nats_server.url) as client:
        await _register(client, tenant)
        job = await client.submit(_sft_spec(tenant))
        events = []
        async for ev in job.events(idle_timeout=30):
            events.append(ev)
            break
        assert type(events[0]).__name__ == "Accepted"
        record = await eventually(lambda: client.status(tenant, job.job_id), what="record")
        assert record.status in ("accepted", "running") and record.kind == "sft"


async def test_master_rejects_bad_spec_naming_the_field_and_dead_letters_it(
    master: subprocess.Popen[bytes], nats_server: EmbeddedServer, js: JetStreamContext
) -> None:
    tenant = uid("acme")
    async with await Client.connect(nats_server.url) as client:
        await _register(client, tenant)
        # Bypass the SDK's local validation: the master must not trust clients.
        spec = json.dumps(_sft_spec(tenant, optimiser={"lr": 0.1})).encode()
        await js.publish(
            subjects.job(tenant, "submit"),
            encode(JobSubmit(tenant, "bad-job", spec, 0.0)),
            headers={headers.JOB_ID: "bad-job"},
        )
        from clients.sdk import Job

        with pytest.raises(JobFailed, match="optimiser: unknown field"):
            await Job(client, tenant, "bad-job").wait(timeout=30)
        dead = await js.subscribe(subjects.dead("JOBS", tenant), ordered_consumer=True)
        msg = await dead.next_msg(timeout=10)
        assert b"optimiser: unknown field" in msg.data
        # The SDK validates locally too, naming the field before anything is sent.
        with pytest.raises(JobSpecError, match=r"head\.action_dim"):
            await client.submit(_sft_spec(tenant, head={"kind": "oft", "action_dim": 0}))


async def test_malformed_message_never_stops_the_master(
    master: subprocess.Popen[bytes], nats_server: EmbeddedServer, js: JetStreamContext
) -> None:
    tenant = uid("acme")
    await js.publish(
        subjects.job(tenant, "submit"), b"\x00garbage", headers={headers.JOB_ID: "junk"}
    )
    await js.publish(
        subjects.job(tenant, "cancel"), encode(JobSubmit(tenant, "wrong-verb", b"{}", 0.0))
    )
    async with await Client.connect(nats_server.url) as client:
        from clients.sdk import Job

        with pytest.raises(JobFailed, match="malformed job command"):
            await Job(client, tenant, "junk").wait(timeout=30)
        await _register(client, tenant)
        job = await client.submit(_sft_spec(tenant))
        record = await eventually(
            lambda: client.status(tenant, job.job_id), timeout=30, what="later job accepted"
        )
        assert record.status in ("accepted", "running")
    assert master.poll() is None


async def test_health_manager_reports_live_roles(
    nats_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    procs.add(start_service("health", nats_server.url, tmp_path / "health.log"))
    procs.add(start_service("envs", nats_server.url, tmp_path / "envs.log"))
    nc = await connect(nats_server.url)
    try:

        async def report_has_envs() -> HealthReport | None:
            try:
                msg = await nc.request(HEALTH_SUBJECT, b"", timeout=1)
            except NatsError:  # health manager not subscribed yet
                return None
            report = decode(HEALTH_REPORT_DECODER, msg.data)
            return report if {"envs", "health"} <= set(report.healthy_roles) else None

        report = await eventually(report_has_envs, timeout=30, what="health report")
        assert "master" in report.missing_roles or "master" in report.healthy_roles
    finally:
        await nc.close()


def test_bad_config_exits_naming_the_field(nats_server: EmbeddedServer) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.master", "--heartbeat-interval-s", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "JOYNEXUS_MAX_DELIVER": "many"},
    )
    assert out.returncode == 2
    assert "--heartbeat-interval-s: Input should be greater than 0" in out.stderr
    assert "JOYNEXUS_MAX_DELIVER: Input should be a valid integer" in out.stderr
    # Found by an audit: these ended in a traceback from deep in the start-up.
    missing = "/nonexistent/ca.pem"
    out = subprocess.run(
        [sys.executable, "-m", "services.master", "--log-level", "FOO", "--tls-ca", missing],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "JOYNEXUS_CREDS": "/nonexistent/x.creds"},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--log-level: Value error, 'FOO' is not one of CRITICAL" in out.stderr
    assert f"--tls-ca: Value error, '{missing}' is not a file" in out.stderr
    assert "JOYNEXUS_CREDS: Value error, '/nonexistent/x.creds' is not a file" in out.stderr


async def test_a_role_whose_bus_does_not_answer_says_so_while_it_waits(
    procs: Procs, tmp_path: Path
) -> None:
    """Found by an audit: a wrong --url looked like a role hanging in silence (the connect
    is retried for ever, as it must be for a broker that restarts)."""
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    log = tmp_path / "health.log"
    proc = procs.add(start_service("health", url, log))
    said = f"health: the bus at {url} does not answer ("
    await eventually(lambda: said in log.read_text() or None, timeout=30, what="the warning")
    proc.terminate()
    assert proc.wait(30) == 0 and "stopped before connecting" in log.read_text()


def test_joynexus_up_check_reports_five_healthy_roles(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "joynexus"),
            "--home",
            str(tmp_path / "home"),
            "up",
            "--check",
            "--timeout",
            "90",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary == {"healthy": list(ROLES), "missing": []}


# With the slow ones: tests/test_broker_faults.py kills the broker mid-job with every role up,
# tests/test_master_replay.py the master with queued jobs.
@pytest.mark.slow
async def test_broker_sigkill_loses_no_accepted_job(tmp_path: Path, procs: Procs) -> None:
    """Jobs whose submit the master queued (the stream acknowledged it) survive a SIGKILL of
    the server and of the master, and are accepted by the master after the restart."""
    server = EmbeddedServer(tmp_path / "nats").start()
    try:
        tenant = uid("crash")
        master = procs.add(start_service("master", server.url, tmp_path / "master-1.log"))
        async with await Client.connect(server.url) as client:
            await declare(client.js)  # as any service does at start-up
            await _register(client, tenant)
            jobs = [await client.submit(_sft_spec(tenant)) for _ in range(5)]
        master.kill()
        server.kill()
        master.wait(10)
        server.restart()
        procs.add(start_service("master", server.url, tmp_path / "master.log"))
        async with await Client.connect(server.url) as client:
            for job in jobs:
                record = await eventually(
                    partial(_status, client, tenant, job.job_id),
                    timeout=30,
                    what=f"{job.job_id} accepted",
                )
                assert record.status in ("accepted", "running")
    finally:
        server.kill()


async def _status(client: Client, tenant: str, job_id: str) -> JobRecord | None:
    try:
        return await client.status(tenant, job_id)
    except (KeyNotFoundError, msgspec.DecodeError):
        return None
