"""The README's commands as a new user runs them: CLI entry points as subprocesses, and
compose.yaml checked statically (tests/test_compose.py runs it for real)."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bus.local import read_stack_info
from clients import sdk
from schemas.health import ROLES
from schemas.specs import JobSpecError
from tests.helpers import ROOT, uid

JOYNEXUS = str(Path(sys.executable).parent / "joynexus")


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [JOYNEXUS, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_model_init_data_record_and_inspect(tmp_path: Path) -> None:
    out = run("model", "init", "tiny", "--out", str(tmp_path / "tiny"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "tiny" / "config.json").exists()
    out = run(
        "data",
        "record",
        "--env",
        "JoyNexus/Reach2D-v0",
        "--episodes",
        "3",
        "--out",
        str(tmp_path / "ds"),
    )
    assert out.returncode == 0, out.stderr
    out = run("data", "inspect", str(tmp_path / "ds"))
    assert out.returncode == 0 and "episodes" in out.stdout.lower()


@pytest.mark.timeout(300)
def test_up_then_submit_watch_and_status(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert (
        run(
            "data",
            "record",
            "--env",
            "JoyNexus/Reach2D-v0",
            "--episodes",
            "8",
            "--out",
            str(tmp_path / "ds"),
        ).returncode
        == 0
    )
    tenant = uid("cli")
    spec = tmp_path / "sft.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "kind": "sft",
                "tenant": tenant,
                "dataset": "ds",  # pushed into the tenant's namespace below
                "steps": 12,
                "batch_size": 4,
                "head": {"kind": "oft", "action_dim": 2, "chunk_len": 2},
            }
        )
    )
    # The stack options after the command name (the scale test puts them before it).
    up = subprocess.Popen(
        [JOYNEXUS, "up", "--home", str(home)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while read_stack_info(home) is None:
            assert up.poll() is None and time.monotonic() < deadline, "stack did not start"
            time.sleep(0.1)
        # Before it is registered, a push for the tenant is refused saying how to add it.
        unknown = run("--home", str(home), "data", "push", str(tmp_path / "ds"), "--tenant", tenant)
        assert unknown.returncode != 0, unknown.stdout
        assert f"joynexus tenant add {tenant}" in unknown.stderr, unknown.stdout + unknown.stderr
        # The tenant gets its own identity; the tenant commands below use its creds file.
        added = run("--home", str(home), "tenant", "add", tenant)
        assert added.returncode == 0, added.stdout + added.stderr
        pushed = run(
            "--home",
            str(home),
            "data",
            "push",
            str(tmp_path / "ds"),
            "--tenant",
            tenant,
            "--id",
            "ds",
        )
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr
        assert f"dataset ds in tenant {tenant}'s namespace" in pushed.stdout
        listed = run("--home", str(home), "data", "list", "--tenant", tenant)
        assert listed.returncode == 0 and "ds " in listed.stdout and "pushed" in listed.stdout
        out = run("submit", str(spec), "--watch", "--home", str(home))
        assert out.returncode == 0, out.stdout + out.stderr
        assert "accepted (sft)" in out.stdout and "succeeded" in out.stdout
        assert "12/12" in out.stdout
        status = run("--home", str(home), "status", "--tenant", tenant)
        assert status.returncode == 0 and "succeeded" in status.stdout
        assert "restarts" not in status.stdout  # a tenant sees its jobs only
        # The operator sees every role (state, pid, uptime, restarts, progress) and its jobs.
        operator = run("--home", str(home), "status")
        assert operator.returncode == 0, operator.stdout + operator.stderr
        roles = [line.split() for line in operator.stdout.splitlines()]
        assert {r[0] for r in roles if len(r) > 2 and r[2] == "alive"} >= set(ROLES), roles
        assert "succeeded" in operator.stdout
        job_id = out.stdout.split(f"submitted {tenant}/", 1)[1].split()[0]
        exported = run(
            "--home", str(home), "export", tenant, job_id, "--out", str(tmp_path / "policy")
        )
        assert exported.returncode == 0, exported.stdout + exported.stderr
        assert (tmp_path / "policy").glob(f"{job_id}-v*.ckpt"), exported.stdout
        ended = run("--home", str(home), "cancel", tenant, job_id)
        assert ended.returncode == 0, ended.stdout + ended.stderr
        assert "has ended already (succeeded): nothing to cancel" in ended.stdout, ended.stdout
        unknown_job = run("--home", str(home), "cancel", tenant, "no-such-job")
        assert unknown_job.returncode == 0, unknown_job.stdout + unknown_job.stderr
        assert "no such job is recorded yet" in unknown_job.stdout, unknown_job.stdout
        watched = run("--home", str(home), "watch", tenant, job_id, timeout=60)
        assert watched.returncode == 0, watched.stdout + watched.stderr
        assert "accepted (sft)" in watched.stdout and "12/12" in watched.stdout
        bad = tmp_path / "bad.yaml"
        bad.write_text(
            yaml.safe_dump(
                {
                    "kind": "sft",
                    "tenant": tenant,
                    "dataset": "x",
                    "steps": 1,
                    "head": {"kind": "oft", "action_dim": 2},
                    "learning_rate": 1,
                }
            )
        )
        out = run("--home", str(home), "submit", str(bad))
        assert out.returncode == 2 and "learning_rate: unknown field" in out.stderr
        # The job has ended: its dataset can leave the namespace, its files with it.
        removed = run("--home", str(home), "data", "rm", "ds", "--tenant", tenant)
        assert removed.returncode == 0, removed.stdout + removed.stderr
        assert f"dataset ds removed from tenant {tenant}'s namespace: record and" in removed.stdout
        listed = run("--home", str(home), "data", "list", "--tenant", tenant)
        assert listed.returncode == 0 and "ds " not in listed.stdout
        again = run("--home", str(home), "data", "rm", "ds", "--tenant", tenant)
        assert again.returncode == 1 and f"no dataset 'ds' of tenant {tenant}" in again.stderr
        # The exported copy kept in the tenant's bucket can go on its own.
        unexported = run("--home", str(home), "export", tenant, job_id, "--rm")
        assert unexported.returncode == 0, unexported.stdout + unexported.stderr
        assert f"removed the exported copies of {tenant}/{job_id} version(s) " in (
            unexported.stdout
        )
        again = run("--home", str(home), "export", tenant, job_id, "--rm")
        assert again.returncode == 1 and "no exported copy of any version" in again.stderr
        # So can the job, with its versions and events; its id is not used again.
        gone = run("--home", str(home), "rm", tenant, job_id)
        assert gone.returncode == 0, gone.stdout + gone.stderr
        assert f"removed {tenant}/{job_id}: " in gone.stdout and " events" in gone.stdout
        status = run("--home", str(home), "status", "--tenant", tenant)
        assert status.returncode == 0 and job_id not in status.stdout
        again = run("--home", str(home), "rm", tenant, job_id)
        assert again.returncode == 1 and f"no job '{job_id}' of tenant {tenant}" in again.stderr
    finally:
        up.send_signal(signal.SIGINT)
        log, _ = up.communicate(timeout=60)  # also closes the pipe
    assert up.returncode == 0, log[-3000:]
    assert read_stack_info(home) is None


@pytest.mark.parametrize(
    ("argv", "home"),
    [
        (["up", "--home", "A"], "A"),
        (["--home", "A", "up"], "A"),
        (["--home", "A", "up", "--home", "B"], "B"),
        (["up"], None),
        (["demo", "--home", "A"], "A"),
        (["scale", "envs", "2", "--home", "A"], "A"),
        (["submit", "s.yaml", "--home", "A", "--watch"], "A"),
        (["--home", "A", "watch", "acme", "job-1"], "A"),
    ],
)
def test_stack_options_are_accepted_before_or_after_the_command(
    argv: list[str], home: str | None
) -> None:
    from bench.cli import build_parser

    assert build_parser().parse_args(argv).home == home


def test_bench_options_pass_through_to_the_bench() -> None:
    from bench.cli import build_parser

    args = build_parser().parse_args(["bench", "sft", "--tenants", "4", "--home", "x"])
    assert (args.what, args.bench_args) == ("sft", ["--tenants", "4", "--home", "x"])


def test_the_sdk_only_cli_has_the_tenant_commands_and_refuses_operator_ones() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "clients.cli", "up"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 2 and "invalid choice: 'up'" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "clients.cli", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0
    assert all(cmd in out.stdout for cmd in ("submit", "watch", "status", "cancel"))


def test_submit_without_a_stack_says_how_to_start_one(tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text("kind: sft\n")
    out = run("--home", str(tmp_path / "none"), "submit", str(spec))
    assert out.returncode == 1 and "joynexus up" in out.stderr


@pytest.mark.parametrize(
    ("port", "ports"), [("65533", "65533..65537"), ("-2", "-2..2"), ("65531", "65531..65536")]
)
def test_metrics_ports_past_the_range_are_refused_before_anything_starts(
    tmp_path: Path, port: str, ports: str
) -> None:
    """Found by an audit: the roles took PORT, PORT + 1, ...; one past 65535 exited at
    start and was restarted for ever, while `up` said the stack was up."""
    args = ["--home", str(tmp_path / "home"), "up", "--metrics-port", port]
    if port == "65531":
        args.append("--backbone-service")  # a sixth role process
    out = run(*args, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"--metrics-port {port}: " in out.stderr and f"take ports {ports}" in out.stderr
    assert not (tmp_path / "home" / "logs").exists()  # nothing was started


@pytest.mark.parametrize(
    ("text", "got"), [("", "an empty file"), ("- kind: sft\n", "a list"), ("sft\n", "a str")]
)
def test_a_spec_file_that_is_no_mapping_is_refused_before_anything_is_sent(
    tmp_path: Path, text: str, got: str
) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(text)
    out = run("--home", str(tmp_path / "none"), "submit", str(spec))
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        f"invalid spec {spec}: a job spec is a mapping (kind: ..., tenant: ...), got {got}"
    )


def test_the_sdk_refuses_a_spec_json_cannot_carry() -> None:
    with pytest.raises(JobSpecError, match=r"a job spec is a mapping .*, got list"):
        sdk._document([{"kind": "sft"}])  # type: ignore[arg-type]
    with pytest.raises(JobSpecError, match=r"spec is not plain JSON data: .*bytes"):
        sdk._spec_json({"kind": "rl", "env": b"\x00"})
    assert sdk._spec_json({"kind": "rl"}) == b'{"kind": "rl"}'


def test_compose_runs_every_role_on_nats_with_a_cluster_profile() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    for role in ROLES:
        svc = services[role]
        assert svc["command"][0] == f"services.{role}"
        importlib.import_module(f"services.{role}.__main__".replace(".__main__", ""))
        assert svc["environment"]["JOYNEXUS_URL"] == "${JOYNEXUS_BUS_URL:-nats://nats:4222}"
        assert svc["depends_on"]["nats"] == {"condition": "service_healthy"}
        assert svc["restart"] == "unless-stopped" and "bus.liveness" in svc["healthcheck"]["test"]
    assert "-js" in services["nats"]["command"]
    cluster = [n for n, s in services.items() if "cluster" in s.get("profiles", [])]
    assert sorted(cluster) == ["nats-1", "nats-2", "nats-3"]
    for name in cluster:
        command = services[name]["command"]
        assert "-js" in command and "--routes" in command and "--cluster_name" in command
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["python", "-m"]' in dockerfile and "torch==2.13.0" in dockerfile


@pytest.mark.stack
@pytest.mark.timeout(400)
def test_scale_env_workers_up_and_down_mid_job(tmp_path: Path) -> None:
    """`joynexus scale envs N` on a running stack changes the worker count while an RL job
    runs; the job completes every iteration regardless."""
    import asyncio

    from clients.sdk import Client
    from schemas.events import Progress

    home = tmp_path / "home"
    up = subprocess.Popen(
        [JOYNEXUS, "--home", str(home), "up"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tenant = uid("elastic")
    iterations = 6

    async def scenario() -> list[int]:
        async with await Client.connect(home=home) as client:
            job = await client.train_rl(
                {
                    "tenant": tenant,
                    "env": "JoyNexus/Reach2D-v0",
                    "env_kwargs": {"num_distractors": 0, "max_speed": 0.2},
                    "max_episode_steps": 20,
                    "iterations": iterations,
                    "episodes_per_iteration": 8,
                    "parallel_envs": 2,
                    "token_budget": 8,
                    "head": {"kind": "oft", "action_dim": 2, "proprio_dim": 4, "value_head": True},
                }
            )
            seen: list[int] = []
            async for ev in job.events(idle_timeout=300):
                if isinstance(ev, Progress):
                    seen.append(ev.step)
                    if ev.step == 1:
                        assert (
                            await asyncio.to_thread(run, "--home", str(home), "scale", "envs", "3")
                        ).returncode == 0
                    if ev.step == 3:
                        assert (
                            await asyncio.to_thread(run, "--home", str(home), "scale", "envs", "1")
                        ).returncode == 0
            await job.wait(60)
            return seen

    try:
        deadline = time.monotonic() + 60
        while read_stack_info(home) is None:
            assert up.poll() is None and time.monotonic() < deadline, "stack did not start"
            time.sleep(0.1)
        # the tenant gets its identity on the running stack (unregistered ones are refused)
        added = run("--home", str(home), "tenant", "add", tenant)
        assert added.returncode == 0, added.stdout + added.stderr
        steps = asyncio.run(scenario())
        assert steps == list(range(1, iterations + 1))
        logs = sorted(p.name for p in (home / "logs").glob("envs*.log"))
        assert len(logs) >= 3, logs  # the scaled-up workers really ran
    finally:
        up.send_signal(signal.SIGINT)
        log, _ = up.communicate(timeout=60)
    assert up.returncode == 0, log[-3000:]


@pytest.mark.parametrize("name", ["sft", "rl", "rl-pushcube", "eval", "pipeline"])
def test_example_specs_are_valid(name: str) -> None:
    from schemas.specs import parse_job_spec

    spec = parse_job_spec(yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text()))
    assert spec.tenant in ("acme", "beta")
