"""Usage accounting per tenant (:mod:`schemas.usage`): what a service charges each tenant, the
loop that reports it on the ``USAGE`` stream, and the reading that adds reports into a bill.

A service charges where it measures its own compute: the seconds it adds to its busy-time
counter are split among the tenants served (:meth:`UsageMeter.split`). Each report also
carries the counter's own increase over the period, read apart from the charges, so a bill
shows whether the tenants' shares add up to what the service measured (compute that no tenant
was charged for would show as a gap). Reports are deltas since the instance's previous
one, published with ``Nats-Msg-Id`` = (instance, seq), so a retried publish is stored once; a
report the broker cannot take is kept and merged into the next. What a process had not yet
reported when it was SIGKILLed (up to one period) is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime

import msgspec
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from bus.codec import DecodeError, decode
from bus.publish import msg_id, publish
from schemas import subjects
from schemas.usage import USAGE_REPORT_DECODER, TenantUsage, UsageReport, UsageService

log = logging.getLogger(__name__)

#: How often a service reports its usage.
REPORT_EVERY_S = 10.0


@dataclass
class Charges:
    """What one tenant was charged so far in the period (the fields of :class:`TenantUsage`)."""

    compute_s: float = 0.0
    samples: int = 0
    env_steps: int = 0
    act_requests: int = 0
    observations: int = 0
    checkpoint_bytes: int = 0

    def add(self, other: Charges) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @classmethod
    def of(cls, usage: TenantUsage) -> Charges:
        """The charges a report line holds."""
        return cls(**{f.name: getattr(usage, f.name) for f in fields(cls)})

    def line(self, tenant: str, job_id: str) -> TenantUsage:
        """These charges as a report line (counts as integers)."""
        counts = {f.name: int(getattr(self, f.name)) for f in fields(self) if f.name != "compute_s"}
        return TenantUsage(tenant, self.compute_s, job_id=job_id, **counts)


#: Who is charged: (tenant, job id).
JobKey = tuple[str, str]


@dataclass
class UsageMeter:
    """A service instance's charges per tenant and job since its last report."""

    period_start: float = field(default_factory=time.time)
    jobs: dict[JobKey, Charges] = field(default_factory=lambda: defaultdict(Charges))

    def charge(self, tenant: str, job_id: str, **amounts: float) -> None:
        """Add ``amounts`` (names of :class:`Charges`) to the tenant's job's."""
        charges = self.jobs[(tenant, job_id)]
        for name, amount in amounts.items():
            setattr(charges, name, getattr(charges, name) + amount)

    def split(self, seconds: float, shares: Mapping[JobKey, float]) -> None:
        """Charge ``seconds`` of compute to the jobs of ``shares`` in proportion to their
        share (samples, observations, steps); none if nothing was shared."""
        total = sum(shares.values())
        if total <= 0:
            return
        for (tenant, job_id), share in shares.items():
            self.charge(tenant, job_id, compute_s=seconds * share / total)

    def take(self, now: float) -> tuple[float, dict[JobKey, Charges]]:
        """The period's start and charges, and a new period from ``now``."""
        taken = (self.period_start, dict(self.jobs))
        self.period_start, self.jobs = now, defaultdict(Charges)
        return taken

    def give_back(self, start: float, jobs: dict[JobKey, Charges]) -> None:
        """Merge charges that could not be reported into the period in progress."""
        self.period_start = min(self.period_start, start)
        for key, charges in jobs.items():
            self.jobs[key].add(charges)


def _report(
    service: UsageService,
    instance: str,
    seq: int,
    start: float,
    end: float,
    busy_s: float,
    jobs: dict[JobKey, Charges],
) -> UsageReport:
    return UsageReport(
        service,
        instance,
        seq,
        start,
        end,
        busy_s,
        [c.line(tenant, job_id) for (tenant, job_id), c in sorted(jobs.items())],
    )


@dataclass
class UsageReporter:
    """Reports ``meter``'s charges on ``nexus.usage.<service>.<instance>``, each with the
    increase of the service's busy seconds ``busy()`` (a counter) since the last report."""

    js: JetStreamContext
    service: UsageService
    instance: str
    meter: UsageMeter
    busy: Callable[[], float]
    every_s: float = REPORT_EVERY_S
    seq: int = 0
    reported_busy: float = 0.0
    #: This process's own token in the reports' msg ids: a restarted role may have the same
    #: instance name (a container restarted in place keeps its hostname, and its pid is 1)
    #: and counts ``seq`` from 1 again, and the server would drop its first reports as
    #: duplicates of the last run's within the duplicate window.
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        self.reported_busy = self.busy()

    async def loop(self, stop: asyncio.Event) -> None:
        """Report every ``every_s`` until ``stop`` (the body's last work is reported by its
        own :meth:`report` after it, when the body has drained)."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)
            if not stop.is_set():
                await self.report()

    async def report(self, timeout: float = 5.0) -> None:
        """Publish what was charged since the last report (nothing if nothing was); a report
        the broker does not take is merged into the next."""
        now = time.time()
        start, jobs = self.meter.take(now)
        busy_now = self.busy()
        busy_s = busy_now - self.reported_busy
        if not jobs and busy_s <= 0:
            return
        seq = self.seq + 1
        report = _report(self.service, self.instance, seq, start, now, busy_s, jobs)
        try:
            await publish(
                self.js,
                subjects.usage(self.service, self.instance),
                report,
                message_id=msg_id("usage", self.instance, self.run, seq),
                timeout=timeout,
            )
        except (NatsError, TimeoutError) as exc:
            log.warning("usage report not published (kept for the next): %s", exc)
            self.meter.give_back(start, jobs)
            return
        self.seq, self.reported_busy = seq, busy_now


@dataclass
class Bill:
    """Usage summed per (tenant, job, service) over the reports read, and each service's
    measured busy seconds (what the tenants' ``compute_s`` must add up to)."""

    by_job: dict[tuple[str, str, str], Charges] = field(
        default_factory=lambda: defaultdict(Charges)
    )
    busy_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    reports: int = 0
    first: float | None = None
    last: float | None = None

    def add(self, report: UsageReport) -> None:
        self.reports += 1
        self.busy_s[report.service] += report.busy_s
        self.first = (
            report.period_start if self.first is None else min(self.first, report.period_start)
        )
        self.last = report.period_end if self.last is None else max(self.last, report.period_end)
        for t in report.tenants:
            self.by_job[(t.tenant, t.job_id, report.service)].add(Charges.of(t))

    def tenants(self) -> list[str]:
        return sorted({tenant for tenant, _, _ in self.by_job})

    def of(self, tenant: str) -> dict[str, Charges]:
        """The tenant's charges per service, over its jobs."""
        services: dict[str, Charges] = defaultdict(Charges)
        for (t, _, service), c in sorted(self.by_job.items()):
            if t == tenant:
                services[service].add(c)
        return dict(sorted(services.items()))

    def charged_s(self) -> dict[str, float]:
        """Compute seconds charged per service, over every tenant."""
        charged: dict[str, float] = defaultdict(float)
        for (_, _, service), c in self.by_job.items():
            charged[service] += c.compute_s
        return dict(charged)

    def jobs_of(self, tenant: str) -> dict[str, dict[str, Charges]]:
        """The tenant's charges per job, then service."""
        jobs: dict[str, dict[str, Charges]] = defaultdict(dict)
        for (t, job_id, service), c in sorted(self.by_job.items()):
            if t == tenant:
                jobs[job_id][service] = c
        return dict(jobs)


async def read_bill(
    js: JetStreamContext,
    since: float | None = None,
    tenant: str | None = None,
    timeout: float = 10.0,
) -> Bill:
    """Add up every usage report published from ``since`` (epoch seconds; None: all kept),
    ``tenant``'s lines only if given. Reads the stream to its end as it is now."""
    bill = Bill()
    info = await js.stream_info(subjects.STREAM_USAGE)
    last_seq = info.state.last_seq
    if info.state.messages == 0:
        return bill
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME if since is not None else DeliverPolicy.ALL,
        opt_start_time=datetime.fromtimestamp(since, UTC) if since is not None else None,
    )
    sub = await js.subscribe(
        f"{subjects.PREFIX}.usage.>", ordered_consumer=True, config=config, manual_ack=True
    )
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                msg = await sub.next_msg(timeout=max(0.05, min(1.0, deadline - loop.time())))
            except TimeoutError:
                if loop.time() >= deadline:
                    raise TimeoutError(
                        f"usage reports not read to the end within {timeout}s"
                    ) from None
                # Nothing more from the start time on (the rest is older): done.
                if since is not None:
                    break
                continue
            try:
                report = decode(USAGE_REPORT_DECODER, msg.data)
            except DecodeError as exc:
                log.warning(
                    "usage report at seq %s unreadable: %s", msg.metadata.sequence.stream, exc
                )
            else:
                _add_for(bill, report, tenant)
            if msg.metadata.sequence.stream >= last_seq:
                break
    finally:
        with contextlib.suppress(NatsError):
            await sub.unsubscribe()
    return bill


def _add_for(bill: Bill, report: UsageReport, tenant: str | None) -> None:
    if tenant is not None:
        lines = [t for t in report.tenants if t.tenant == tenant]
        report = msgspec.structs.replace(report, tenants=lines)
    bill.add(report)


def stored_checkpoint_bytes(names_and_sizes: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Bytes each tenant has in the checkpoints object store now (its objects are named
    ``<tenant>/...``: :func:`bus.checkpoints.object_name`)."""
    stored: dict[str, int] = defaultdict(int)
    for name, size in names_and_sizes:
        stored[name.split("/", 1)[0]] += size
    return dict(stored)
