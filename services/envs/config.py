"""The env worker's settings: flags and ``JOYNEXUS_*`` variables (:mod:`bus.config`), and
its fault injection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

from pydantic import Field

from bus.config import DatasetsConfig
from schemas.limits import InputLimits
from services.envs.pool import DEFAULT_MAX_IDLE

log = logging.getLogger(__name__)


class EnvsConfig(DatasetsConfig):
    """Env worker settings."""

    concurrency: int = Field(8, ge=1, description="Tasks (streams, sessions) run at once.")
    max_deliver: int = Field(5, ge=1, description="Deliveries before a task is dead.")
    ack_wait_s: float = Field(
        30.0,
        gt=1,
        description="Task ack wait: how soon a dead worker's tasks go to another "
        "(running ones get in-progress acks every third of it).",
    )
    backbones: str = Field("tiny", description="Backbone ids whose inferencers to ask (a,b).")
    max_idle_sessions: int = Field(
        DEFAULT_MAX_IDLE,
        ge=0,
        description="Simulator sessions kept idle for reuse across tasks; past it the least "
        "recently used kinds (env, image size, episode limit, env kwargs) are closed.",
    )
    limit: InputLimits = Field(
        default_factory=InputLimits, description="Input bounds (--limit-*, JOYNEXUS_LIMIT_*)."
    )
    hang_after_s: float = Field(
        0.0,
        ge=0,
        description="Fault injection: block the event loop this long after start (0: never), "
        "once per --hang-marker file (the restarted worker does not hang again).",
    )
    hang_marker: str = Field("", description="Fault injection: see --hang-after-s.")


async def hang_later(config: EnvsConfig, stop: asyncio.Event) -> None:
    """Fault injection: a frozen worker (its event loop blocked: no heartbeat, no work).
    Returns only once the service stops, as every spawned task."""
    marker = Path(config.hang_marker)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), config.hang_after_s)
    if stop.is_set() or marker.exists():  # noqa: ASYNC240 - fault injection, once
        await stop.wait()
        return
    marker.write_text(str(os.getpid()))  # noqa: ASYNC240
    log.warning("fault injection: blocking the event loop")
    time.sleep(3600)  # noqa: ASYNC251 - the point: a frozen process
