"""A liveness file for supervisors that cannot read the bus (a container's health check).

With ``--health-file FILE`` (``JOYNEXUS_HEALTH_FILE``) a role touches FILE after each
heartbeat the bus accepted (:mod:`bus.service`), so the file's age says how long ago the
role last reached the bus with a live event loop. ``python -m bus.liveness FILE
--max-age-s 30`` exits 0 when the file is fresher than that, 1 (saying why) otherwise:
compose.yaml's health check for every role.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def mark_alive(path: str | Path) -> None:
    """Set ``path``'s modification time to now (creating it); a failure is logged, never
    raised: a full or read-only disk must not stop the heartbeat."""
    try:
        Path(path).touch()
    except OSError as exc:
        log.warning("health file %s not touched: %s", path, exc)


def age_s(path: str | Path, now: float | None = None) -> float:
    """Seconds since ``path`` was last touched. Raises FileNotFoundError if it never was."""
    return (time.time() if now is None else now) - os.stat(path).st_mtime


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bus.liveness",
        description="Exit 0 if the role that writes FILE heartbeated within --max-age-s.",
    )
    parser.add_argument("file", help="the role's --health-file")
    parser.add_argument("--max-age-s", type=float, default=30.0, help="oldest still healthy")
    args = parser.parse_args(argv)
    try:
        age = age_s(args.file)
    except FileNotFoundError:
        print(f"unhealthy: {args.file} does not exist (no heartbeat reached the bus yet)")
        return 1
    if age > args.max_age_s:
        print(f"unhealthy: last heartbeat {age:.1f} s ago (more than {args.max_age_s:g} s)")
        return 1
    print(f"healthy: last heartbeat {age:.1f} s ago")
    return 0


if __name__ == "__main__":
    sys.exit(main())
