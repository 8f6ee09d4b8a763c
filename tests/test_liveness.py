"""The liveness file a container's health check reads (compose.yaml): a role touches it at
each heartbeat the bus took; ``python -m bus.liveness`` judges its age."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bus.liveness import age_s, main
from bus.server import EmbeddedServer
from tests.conftest import Procs
from tests.helpers import ROOT, eventually, start_service


def test_a_missing_or_stale_file_is_unhealthy_and_says_why(tmp_path: Path, capsys: object) -> None:
    alive = tmp_path / "alive"
    assert main([str(alive)]) == 1
    alive.touch()
    assert main([str(alive), "--max-age-s", "30"]) == 0
    an_hour_ago = time.time() - 3600
    os.utime(alive, (an_hour_ago, an_hour_ago))
    assert age_s(alive) >= 3600
    assert main([str(alive), "--max-age-s", "30"]) == 1
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "does not exist" in out and "healthy: last heartbeat" in out
    assert "more than 30 s" in out


async def test_a_role_touches_its_health_file_at_each_heartbeat(
    nats_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    alive = tmp_path / "alive"
    proc = procs.add(
        start_service(
            "master", nats_server.url, tmp_path / "master.log", "--health-file", str(alive)
        )
    )

    def healthy() -> bool:
        check = subprocess.run(
            [sys.executable, "-m", "bus.liveness", str(alive), "--max-age-s", "5"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        return check.returncode == 0

    await eventually(healthy, timeout=30, interval=0.5, what="the master's first heartbeat")
    first = alive.stat().st_mtime_ns
    await eventually(lambda: alive.stat().st_mtime_ns > first, timeout=10, what="a new touch")
    assert procs.stop(proc) == 0
