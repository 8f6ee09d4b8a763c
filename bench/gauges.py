"""Reading what the services measure of themselves, from outside: their heartbeats' gauges.

Every role instance writes a heartbeat a second into the ``heartbeats`` KV with cumulative
counters (``busy_s``: seconds computing, ``active_s``: seconds with work in hand, and the
role's own). :class:`Sampler` polls them for a run and keeps every distinct reading, so a
phase's totals are differences between two readings (:meth:`Sampler.totals`) and the
utilisation over time is the slope between consecutive ones (:meth:`Sampler.timeline`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from bus.codec import DecodeError, decode
from bus.kv import kv_values
from schemas import subjects
from schemas.health import HEARTBEAT_DECODER

log = logging.getLogger(__name__)

#: The services whose time is held and accounted: role → service name.
SERVICE_OF_ROLE = {"trainer": "train", "inferencer": "infer", "envs": "env"}
SERVICES = ("train", "infer", "env")


@dataclass(frozen=True)
class Reading:
    """One heartbeat of one role instance."""

    at: float
    role: str
    instance: str
    gauges: dict[str, float]


@dataclass
class Sampler:
    """Polls the heartbeats every ``interval_s`` while running; keeps each instance's
    distinct readings in order."""

    js: JetStreamContext
    interval_s: float = 0.25
    readings: dict[str, list[Reading]] = field(default_factory=lambda: defaultdict(list))
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def poll_once(self) -> None:
        try:
            values = await kv_values(self.js, subjects.KV_HEARTBEATS)
        except NatsError as exc:  # a missed poll only coarsens the timeline
            log.debug("heartbeat poll failed: %s", exc)
            return
        for key, value in values.items():
            with contextlib.suppress(DecodeError):
                beat = decode(HEARTBEAT_DECODER, value)
                if beat.role not in SERVICE_OF_ROLE:
                    continue
                seen = self.readings[key]
                if not seen or beat.at > seen[-1].at:
                    seen.append(Reading(beat.at, beat.role, beat.instance, dict(beat.gauges)))

    async def run(self) -> None:
        while not self._stop.is_set():
            await self.poll_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval_s)

    def stop(self) -> None:
        self._stop.set()

    async def fresh(self, after: float, timeout: float = 10.0) -> None:
        """Wait until every instance has a reading taken after ``after`` (wall time), so the
        counters include everything done before it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await self.poll_once()
            if self.readings and all(r[-1].at > after for r in self.readings.values()):
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"no fresh heartbeat from every service within {timeout}s")

    def at(self, when: float) -> dict[str, Reading]:
        """Each instance's last reading at or before ``when``."""
        out = {}
        for key, seen in self.readings.items():
            before = [r for r in seen if r.at <= when]
            if before:
                out[key] = before[-1]
        return out

    def after(self, when: float) -> dict[str, Reading]:
        """Each instance's first reading after ``when``."""
        out = {}
        for key, seen in self.readings.items():
            later = [r for r in seen if r.at > when]
            if later:
                out[key] = later[0]
        return out

    def instances(self) -> dict[str, int]:
        """Instances per service seen so far."""
        counts: dict[str, int] = defaultdict(int)
        for seen in self.readings.values():
            counts[SERVICE_OF_ROLE[seen[0].role]] += 1
        return dict(counts)

    def totals(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """Per service, the increase of every gauge between the readings bracketing
        ``[start, end]`` (the last at or before ``start``, the first after ``end``), summed
        over the service's instances."""
        first, last = self.at(start), self.after(end)
        out: dict[str, dict[str, float]] = {s: defaultdict(float) for s in SERVICES}
        for key, begin in first.items():
            finish = last.get(key)
            if finish is None:
                continue
            service = SERVICE_OF_ROLE[begin.role]
            for name, value in finish.gauges.items():
                out[service][name] += value - begin.gauges.get(name, 0.0)
        return {s: dict(v) for s, v in out.items()}

    def timeline(
        self, start: float, end: float, gauge: str = "busy_s"
    ) -> dict[str, list[tuple[float, float]]]:
        """Per service, ``(seconds since start, utilisation)`` points: the slope of ``gauge``
        between consecutive readings, averaged over the service's instances."""
        points: dict[str, list[tuple[float, float]]] = defaultdict(list)
        per_service: dict[str, list[list[Reading]]] = defaultdict(list)
        for seen in self.readings.values():
            inside = [r for r in seen if start - 1.5 <= r.at <= end + 1.5]
            if len(inside) >= 2:
                per_service[SERVICE_OF_ROLE[seen[0].role]].append(inside)
        for service, instances in per_service.items():
            # Sample every instance's utilisation on a common grid of its readings' midpoints.
            grid = sorted({(a.at + b.at) / 2 for s in instances for a, b in itertools.pairwise(s)})
            for t in grid:
                if not start <= t <= end:
                    continue
                values = [_slope(s, t, gauge) for s in instances]
                points[service].append((t - start, sum(values) / len(values)))
        return dict(points)


def _slope(seen: list[Reading], t: float, gauge: str) -> float:
    """The rate of ``gauge`` over the pair of readings around ``t`` (0 outside them)."""
    for a, b in itertools.pairwise(seen):
        if a.at <= t <= b.at and b.at > a.at:
            rate = (b.gauges.get(gauge, 0.0) - a.gauges.get(gauge, 0.0)) / (b.at - a.at)
            return max(0.0, min(1.0, rate))
    return 0.0
