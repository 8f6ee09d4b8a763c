"""Which backbones the stack serves: checked at submit, watched while jobs run.

A spec's ``backbone:`` must name a served id: one the stack declares (``--backbones``, what
``joynexus up`` starts) or one a trainer or inferencer has announced in the ``placement`` KV.
A job for any other id is rejected at submit, and the rejection lists the served ones.

A backbone can be declared and still not be served (its trainer crash-loops on a checkpoint
it cannot load, or was killed and stays down). :meth:`BackboneWatch.run` follows the live
placements (records whose instance heartbeats); when a role a job needs (SFT: trainer, RL:
trainer and inferencer, eval: inferencer) has had no live instance for a backbone for
``deadline_s``, every unfinished job of that kind on it fails with that reason instead of
hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from bus.errors import PoisonError, RetryableError
from bus.placement import live_placements, placements
from bus.records import list_jobs
from schemas.jobs import TERMINAL_STATUSES
from schemas.specs import JobSpecError, parse_job_spec

log = logging.getLogger(__name__)

#: The roles a job of each kind cannot progress without.
NEEDS: dict[str, tuple[str, ...]] = {
    "sft": ("trainer",),
    "rl": ("trainer", "inferencer"),
    "eval": ("inferencer",),
}

Fail = Callable[[str, str, str], Awaitable[None]]


class BackboneWatch:
    """The master's view of the served backbones."""

    def __init__(self, js: JetStreamContext, declared: list[str], deadline_s: float) -> None:
        self.js = js
        self.declared = sorted(set(declared))
        self.deadline_s = deadline_s
        #: (backbone, role) -> when the master first saw it without a live instance.
        self.down_since: dict[tuple[str, str], float] = {}
        self._last_scan = 0.0

    async def served(self) -> list[str]:
        """Declared ids plus every id a placement record names."""
        return sorted(set(self.declared) | {r.backbone for r in await placements(self.js)})

    async def check(self, backbone: str) -> None:
        """Raise :class:`PoisonError` (the submit is rejected) unless ``backbone`` is served."""
        if backbone in self.declared:
            return
        served = await self.served()
        if backbone not in served:
            raise PoisonError(
                f"backbone: {backbone!r} is not served by this stack; served: {served}"
            )

    async def tick(self, fail: Fail, now: float | None = None) -> None:
        """Update the down timers; fail the unfinished jobs of any role past the deadline."""
        now = time.time() if now is None else now
        live = {(r.backbone, r.role) for r in await live_placements(self.js)}
        for backbone in await self.served():
            for role in ("trainer", "inferencer"):
                if (backbone, role) in live:
                    self.down_since.pop((backbone, role), None)
                else:
                    self.down_since.setdefault((backbone, role), now)
        expired = {k for k, since in self.down_since.items() if now - since >= self.deadline_s}
        # Scanning every job is the costly part: do it when something is past the deadline,
        # at most every quarter deadline (a job submitted meanwhile waits that much longer).
        if not expired or now - self._last_scan < min(self.deadline_s / 4, 15.0):
            return
        self._last_scan = now
        for job in await list_jobs(self.js):
            needs = NEEDS.get(job.kind, ())
            if job.status in TERMINAL_STATUSES or not needs:
                continue
            try:
                backbone = parse_job_spec(job.spec_json).backbone  # type: ignore[union-attr]
            except (JobSpecError, AttributeError):
                continue
            for role in needs:
                if (backbone, role) in expired:
                    down = now - self.down_since[(backbone, role)]
                    reason = (
                        f"backbone {backbone!r}: no {role} has served it for {down:.0f} s "
                        f"(deadline {self.deadline_s:g} s)"
                    )
                    log.warning("failing %s/%s: %s", job.tenant, job.job_id, reason)
                    await fail(job.tenant, job.job_id, reason)
                    break

    async def run(self, stop: asyncio.Event, fail: Fail) -> None:
        """Tick until ``stop``; a bus error or a lost race is retried on the next tick."""
        period = min(1.0, self.deadline_s / 4)
        while not stop.is_set():
            try:
                await self.tick(fail)
            except (NatsError, RetryableError, TimeoutError, OSError) as exc:
                log.warning("backbone watch: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period)
