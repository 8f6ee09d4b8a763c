"""``joynexus top``: a live view of a running stack — jobs and their progress, every role
instance's utilisation, and each scheduling service's queue per tenant — refreshing in place.

It reads what the services already publish: heartbeats (the ``heartbeats`` KV: cumulative
``busy_s``, work in flight, progress), job records and committed policies (``jobs`` and
``policies`` KV), and the queue reports (core NATS ``nexus.metrics.queues.*``). A role's
utilisation is the increase of its ``busy_s`` between two of its heartbeats over the time
between them. Drawn with ``rich``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from bus.codec import DecodeError, decode
from bus.kv import kv_values
from bus.records import get_policy, list_jobs
from schemas import subjects
from schemas.health import HEARTBEAT_DECODER, Heartbeat
from schemas.jobs import TERMINAL_STATUSES, JobRecord
from schemas.metrics import QUEUE_REPORT_DECODER, QueueReport
from schemas.train import PolicyRecord

#: Finished jobs shown below the running ones (the most recent).
FINISHED_SHOWN = 8
#: Metrics worth a column's word, in this order.
_METRICS = ("loss", "return_mean", "success_rate", "samples_per_s")


@dataclass(frozen=True)
class RoleRow:
    role: str
    instance: str
    #: busy seconds per second over the last two heartbeats (None: not measured yet).
    utilisation: float | None
    in_flight: int
    progress: int
    age_s: float
    busy_with: str


@dataclass(frozen=True)
class JobRow:
    tenant: str
    job_id: str
    kind: str
    status: str
    #: (done, total) steps or iterations, when the job has a count to reach.
    progress: tuple[int, int] | None
    version: int
    metrics: dict[str, float]
    reason: str


@dataclass
class Frame:
    at: float
    roles: list[RoleRow]
    jobs: list[JobRow]
    queues: list[QueueReport]


@dataclass
class Watcher:
    """Keeps what a frame needs between refreshes: each instance's previous heartbeat (for
    its utilisation) and each service's latest queue report."""

    js: JetStreamContext
    previous: dict[str, Heartbeat] = field(default_factory=dict)
    utilisation: dict[str, float] = field(default_factory=dict)
    queues: dict[tuple[str, str], QueueReport] = field(default_factory=dict)
    #: When (this watcher's monotonic clock) each queue report, and each instance's latest
    #: heartbeat, arrived: ages are never read from the sender's clock, which may be skewed.
    received: dict[tuple[str, str], float] = field(default_factory=dict)
    beat_seen: dict[str, float] = field(default_factory=dict)
    _sub: Subscription | None = None

    async def listen(self, nc: NATS) -> None:
        async def keep(msg: Msg) -> None:
            with contextlib.suppress(DecodeError):
                report = decode(QUEUE_REPORT_DECODER, msg.data)
                self.queues[(report.service, report.instance)] = report
                self.received[(report.service, report.instance)] = time.monotonic()

        self._sub = await nc.subscribe(f"{subjects.QUEUE_METRICS}.>", cb=keep)

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(NatsError):
                await self._sub.unsubscribe()

    async def frame(self) -> Frame:
        now = time.monotonic()
        beats = await self._heartbeats()
        roles = [self._role_row(key, beat, now) for key, beat in sorted(beats.items())]
        jobs = await self._jobs()
        live = {(r.role, r.instance) for r in roles}
        queues = [
            q
            for key, q in sorted(self.queues.items())
            if key in live and now - self.received.get(key, -math.inf) < 10.0
        ]
        return Frame(time.time(), roles, jobs, queues)

    async def _heartbeats(self) -> dict[str, Heartbeat]:
        beats = {}
        for key, value in (await kv_values(self.js, subjects.KV_HEARTBEATS)).items():
            with contextlib.suppress(DecodeError):
                beats[key] = decode(HEARTBEAT_DECODER, value)
        return beats

    def _role_row(self, key: str, beat: Heartbeat, now: float) -> RoleRow:
        """``now``: this watcher's monotonic clock. Utilisation is a difference of the
        sender's own readings (its clock's offset cancels); the age is how long ago this
        watcher first saw the heartbeat (the bucket's TTL drops one that stops)."""
        before = self.previous.get(key)
        if before is not None and beat.at > before.at and "busy_s" in beat.gauges:
            busy = beat.gauges["busy_s"] - before.gauges.get("busy_s", 0.0)
            self.utilisation[key] = max(0.0, busy / (beat.at - before.at))
        if before is None or beat.at > before.at:
            self.previous[key] = beat
            self.beat_seen[key] = now
        return RoleRow(
            beat.role,
            beat.instance,
            self.utilisation.get(key),
            beat.in_flight,
            beat.progress,
            max(0.0, now - self.beat_seen.get(key, now)),
            beat.busy_with,
        )

    async def _jobs(self) -> list[JobRow]:
        records = await list_jobs(self.js)
        running = [r for r in records if r.status not in TERMINAL_STATUSES]
        finished = sorted(
            (r for r in records if r.status in TERMINAL_STATUSES), key=lambda r: r.updated_at
        )[-FINISHED_SHOWN:]
        policies = await self.js.key_value(subjects.KV_POLICIES)
        rows = []
        for record in [*running, *finished]:
            policy, _ = await get_policy(policies, record.tenant, record.job_id)
            rows.append(job_row(record, policy))
        return rows


def job_row(record: JobRecord, policy: PolicyRecord | None) -> JobRow:
    """A job's line: its progress from its committed policy against its spec's count (SFT
    steps, RL iterations; the initial weights are version 1)."""
    try:
        spec = json.loads(record.spec_json)
    except ValueError:
        spec = {}
    total = int(spec.get("steps", 0) or 0) if record.kind == "sft" else 0
    if record.kind == "rl":
        total = int(spec.get("iterations", 0) or 0)
    progress = None
    if total > 0:
        done = 0
        if policy is not None:
            done = policy.step if record.kind == "sft" else max(0, policy.version - 1)
        if record.status == "succeeded":
            done = total
        progress = (min(done, total), total)
    metrics = {**(policy.metrics if policy else {}), **record.metrics}
    return JobRow(
        record.tenant,
        record.job_id,
        record.kind,
        record.status,
        progress,
        policy.version if policy else record.policy_version,
        metrics,
        record.reason,
    )


def _bar(done: int, total: int, width: int = 20) -> Text:
    filled = int(width * done / total) if total else 0
    return Text("█" * filled, style="green") + Text("░" * (width - filled), style="dim")


def render(frame: Frame, url: str = "") -> RenderableType:
    """One screen: a header line, then jobs, services and queues."""
    running = sum(1 for j in frame.jobs if j.status not in TERMINAL_STATUSES)
    header = Text(
        f"JoyNexus  {time.strftime('%H:%M:%S', time.localtime(frame.at))}  {url}  "
        f"{len(frame.roles)} role instances  {running} jobs running",
        style="bold",
    )
    jobs = Table(title="jobs", title_justify="left", expand=False)
    for column in ("tenant", "job", "kind", "status", "progress", "", "version", "metrics"):
        jobs.add_column(column)
    for j in frame.jobs:
        bar: RenderableType = ""
        count = ""
        if j.progress is not None:
            done, total = j.progress
            bar, count = _bar(done, total), f"{done}/{total}"
        words = " ".join(f"{k}={j.metrics[k]:.4g}" for k in _METRICS if k in j.metrics)
        if j.reason and j.status in ("failed", "queued", "cancelled"):
            words = (words + " " + j.reason)[:80]
        style = {"failed": "red", "succeeded": "green", "queued": "yellow"}.get(j.status, "")
        jobs.add_row(
            j.tenant,
            j.job_id,
            j.kind,
            Text(j.status, style=style),
            bar,
            count,
            str(j.version or ""),
            words,
        )
    roles = Table(title="services", title_justify="left")
    for column in (
        "role",
        "instance",
        "utilisation",
        "",
        "in flight",
        "progress",
        "beat",
        "busy with",
    ):
        roles.add_column(column)
    for r in frame.roles:
        util: RenderableType = "-"
        shown = ""
        if r.utilisation is not None:
            util, shown = _bar(int(min(1.0, r.utilisation) * 100), 100, 12), f"{r.utilisation:.0%}"
        roles.add_row(
            r.role,
            r.instance,
            util,
            shown,
            str(r.in_flight),
            str(r.progress),
            f"{r.age_s:.1f}s",
            r.busy_with,
        )
    queues = Table(title="queues (per tenant)", title_justify="left")
    for column in ("service", "instance", "queue", "tenant", "depth", "oldest wait"):
        queues.add_column(column)
    for q in frame.queues:
        for t in q.tenants:
            queues.add_row(
                q.service, q.instance, q.queue, t.tenant, str(t.depth), f"{t.oldest_wait_s:.1f}s"
            )
        if not q.tenants:
            queues.add_row(q.service, q.instance, q.queue, "(empty)", "0", "")
    return Group(header, jobs, roles, queues)


async def run_top(
    nc: NATS,
    *,
    interval_s: float = 1.0,
    frames: int | None = None,
    once: bool = False,
    url: str = "",
    console: Console | None = None,
) -> int:
    """Refresh every ``interval_s`` until Ctrl-C, or ``frames`` times; ``once``: print one
    frame (taken after one interval, so utilisations are measured) and return."""
    console = console or Console()
    watcher = Watcher(nc.jetstream())
    await watcher.listen(nc)
    try:
        await watcher.frame()
        if once:
            await asyncio.sleep(max(interval_s, 2.1))  # a queue report comes every 2 s
            console.print(render(await watcher.frame(), url))
            return 0
        shown = 0
        with Live(render(await watcher.frame(), url), console=console, auto_refresh=False) as live:
            while frames is None or shown < frames:
                await asyncio.sleep(interval_s)
                live.update(render(await watcher.frame(), url), refresh=True)
                shown += 1
        return 0
    finally:
        await watcher.close()
