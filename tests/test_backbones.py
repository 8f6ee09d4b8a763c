"""A stack serving several backbones, as an operator runs it: ``joynexus up --backbone``,
``joynexus backbones``, jobs through ``joynexus submit`` (real nats-server, real processes,
tiny checkpoints written by ``joynexus model init``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from bus.local import read_stack_info
from tests.helpers import ROOT, uid
from tests.test_cli import JOYNEXUS, run
from vla.tiny import TINY_NAMES

#: Prefer an architecture other than Idefics3 (tiny, tiny-224) and Llava (tiny-llava).
PREFERRED = ("paligemma", "tiny-paligemma", "idefics2", "tiny-idefics2", "llava-next")
ARCH = next((n for n in PREFERRED if n in TINY_NAMES), TINY_NAMES[-1])


@contextmanager
def stack(home: Path, *args: str, **env: str) -> Iterator[subprocess.Popen[str]]:
    up = subprocess.Popen(
        [JOYNEXUS, "up", "--home", str(home), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1", **env),
    )
    try:
        deadline = time.monotonic() + 60
        while read_stack_info(home) is None:
            assert up.poll() is None and time.monotonic() < deadline, up.stdout and up.stdout.read()
            time.sleep(0.1)
        yield up
    finally:
        up.send_signal(signal.SIGINT)
        log, _ = up.communicate(timeout=60)
        assert up.returncode == 0, log[-3000:]


def write_spec(path: Path, **spec: object) -> str:
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def listed(home: Path, want: int, timeout: float = 120) -> str:
    """``joynexus backbones`` once it lists ``want`` backbones with a trainer and an
    inferencer each."""
    deadline = time.monotonic() + timeout
    while True:
        out = run("backbones", "--home", str(home), timeout=30)
        rows = [line.split() for line in out.stdout.splitlines()[1:]]
        if len(rows) == want and all(r[-2:] == ["1", "1"] for r in rows):
            return out.stdout
        assert time.monotonic() < deadline, out.stdout + out.stderr
        time.sleep(1)


@pytest.mark.timeout(420)
def push(home: Path, ds: Path, tenant: str) -> None:
    """Add ``tenant`` to the running stack (its own identity: the commands below pick its
    creds from the home) and push ``ds`` into its namespace as dataset ``ds``."""
    added = run("--home", str(home), "tenant", "add", tenant)
    assert added.returncode == 0, added.stdout + added.stderr
    out = run("--home", str(home), "data", "push", str(ds), "--tenant", tenant, "--id", "ds")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.stack
def test_up_on_a_saved_checkpoint_plus_tiny_serves_both_and_runs_sft_and_eval_on_it(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / f"my-{ARCH}"
    assert run("model", "init", ARCH, "--out", str(ckpt)).returncode == 0
    model_type = json.loads((ckpt / "config.json").read_text())["model_type"]
    ds = tmp_path / "ds"
    rec = run("data", "record", "--env", "JoyNexus/Reach2D-v0", "--episodes", "6", "--out", str(ds))
    assert rec.returncode == 0, rec.stderr
    home, tenant, bid = tmp_path / "home", uid("bb"), f"my-{ARCH}"
    with stack(home, "--backbone", str(ckpt), "--backbone", "tiny"):
        table = listed(home, 2)
        assert f"{bid} " in table and model_type in table and "tiny " in table, table
        push(home, ds, tenant)
        print(f"ran on architecture {model_type} ({ARCH})\n{table}")

        # Unserved: rejected at submit, naming what is served.
        nope = write_spec(
            tmp_path / "nope.yaml",
            kind="sft",
            tenant=tenant,
            backbone="nope",
            dataset="ds",
            steps=2,
            head={"kind": "oft", "action_dim": 2},
        )
        out = run("--home", str(home), "submit", nope, "--watch", timeout=60)
        assert out.returncode != 0, out.stdout
        assert "'nope' is not served" in out.stdout + out.stderr
        assert bid in out.stdout + out.stderr and "tiny" in out.stdout + out.stderr

        sft = write_spec(
            tmp_path / "sft.yaml",
            kind="sft",
            tenant=tenant,
            backbone=bid,
            dataset="ds",
            steps=6,
            batch_size=4,
            head={"kind": "oft", "action_dim": 2, "chunk_len": 2},
        )
        out = run("--home", str(home), "submit", sft, "--watch")
        assert out.returncode == 0 and "succeeded" in out.stdout, out.stdout + out.stderr
        job = out.stdout.split(f"submitted {tenant}/", 1)[1].split()[0]
        ev = write_spec(
            tmp_path / "eval.yaml",
            kind="eval",
            tenant=tenant,
            backbone=bid,
            policy_job=job,
            env="JoyNexus/Reach2D-v0",
            episodes=4,
            max_episode_steps=10,
        )
        out = run("--home", str(home), "submit", ev, "--watch")
        assert out.returncode == 0 and "succeeded" in out.stdout, out.stdout + out.stderr


@pytest.mark.timeout(300)
def test_a_job_whose_backbone_trainer_stays_down_fails_past_the_deadline(tmp_path: Path) -> None:
    # A checkpoint no trainer can load: it crash-loops, and the job must not hang.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    ds = tmp_path / "ds"
    rec = run("data", "record", "--env", "JoyNexus/Reach2D-v0", "--episodes", "4", "--out", str(ds))
    assert rec.returncode == 0, rec.stderr
    home, tenant = tmp_path / "home", uid("down")
    with stack(home, "--backbone", str(broken), JOYNEXUS_BACKBONE_DEADLINE_S="4"):
        push(home, ds, tenant)
        sft = write_spec(
            tmp_path / "sft.yaml",
            kind="sft",
            tenant=tenant,
            backbone="broken",
            dataset="ds",
            steps=2,
            head={"kind": "oft", "action_dim": 2},
        )
        started = time.monotonic()
        out = run("--home", str(home), "submit", sft, "--watch", timeout=120)
        assert out.returncode != 0, out.stdout
        assert "no trainer has served it" in out.stdout + out.stderr, out.stdout + out.stderr
        assert time.monotonic() - started < 90
        status = run("--home", str(home), "status", "--tenant", tenant)
        assert "failed" in status.stdout and "backbone 'broken'" in status.stdout
