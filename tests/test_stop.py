"""The stop protocol under stress: every role's entry point, SIGTERMed at random moments —
during its imports and model load, right after it logs ``started``, and while it runs — exits
0 within 5 s every time (issue 8). The default suite stops each role 5 times; the slow
marker 50 times."""

from __future__ import annotations

import random
import signal
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from bus.server import EmbeddedServer
from tests.conftest import Procs
from tests.helpers import catches_sigterm, start_service

ROLES = ("master", "trainer", "inferencer", "envs", "health", "backbone")
#: What the issue asks of a stop, measured from the signal to the exit.
STOP_BOUND_S = 5.0


def wait_for_log(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if text in log.read_text(errors="replace"):
            return True
        time.sleep(0.02)
    return False


def stop_once(role: str, url: str, log: Path, procs: Procs, moment: str, rng: random.Random) -> str:
    """Start the role, SIGTERM it at ``moment``; return a failure description or ''."""
    proc = procs.add(start_service(role, url, log))
    deadline = time.monotonic() + 30
    while not catches_sigterm(proc) and time.monotonic() < deadline:
        time.sleep(0.001)  # the ~50 ms before the entry point's first line runs: not a stop
    if moment == "started":
        if not wait_for_log(log, " started (pid", proc, 60):
            return f"{role} never logged started (rc={proc.poll()})"
    else:
        time.sleep(rng.uniform(0.0, 1.5) if moment == "early" else rng.uniform(0.0, 7.0))
    if proc.poll() is not None:
        return f"{role} exited by itself with {proc.returncode} before the signal ({moment})"
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    try:
        rc = proc.wait(STOP_BOUND_S + 5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return f"{role} did not exit within {STOP_BOUND_S + 5:.0f} s of SIGTERM ({moment})"
    took = time.monotonic() - t0
    if rc != 0 or took > STOP_BOUND_S:
        return f"{role}: exit {rc} after {took:.1f} s ({moment})"
    return ""


def stress(role: str, times: int, url: str, tmp_path: Path, procs: Procs, seed: int) -> None:
    rng = random.Random(seed)
    moments = ["early", "started"] + ["random"] * (times - 2)
    rng.shuffle(moments)
    failures = []
    for i, moment in enumerate(moments):
        log = tmp_path / f"{role}-{i}.log"
        failure = stop_once(role, url, log, procs, moment, rng)
        if failure:
            failures.append(f"{failure}; log tail: {log.read_text(errors='replace')[-600:]}")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("role", ROLES)
def test_every_stop_exits_0_within_5_s(
    role: str, nats_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    # early, started and one random moment (the fifty-stop soak below runs with the slow ones)
    stress(role, 3, nats_server.url, tmp_path, procs, seed=zlib.crc32(role.encode()))


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("role", ROLES)
def test_fifty_stops_each_exit_0_within_5_s(
    role: str, nats_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    stress(role, 50, nats_server.url, tmp_path, procs, seed=random.randrange(10**6))
