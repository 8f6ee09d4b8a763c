"""The master's queued jobs: a job that would take its tenant past its limits waits, and is
started, oldest first, when the tenant's running jobs leave room (see
:mod:`services.master.limits` for what counts).

Room appears when one of the tenant's jobs ends (:meth:`Admissions.noted` wakes the loop at
once); a sweep every :data:`ADMIT_SWEEP_S` also looks at every tenant with queued jobs, so a
limit the operator raised, or a wake-up lost to a crash, is seen. One admission decision at
a time (:attr:`Admissions.lock`, which submits take too): counting what runs and then starting
cannot race another start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from nats.errors import Error as NatsError

from bus.errors import HandlerError, PoisonError, RetryableError
from bus.queues import per_tenant
from bus.records import list_jobs
from schemas.jobs import TERMINAL_STATUSES, JobRecord
from schemas.metrics import TenantQueue
from schemas.specs import parse_job_spec
from schemas.tenants import TenantLimits
from services.master.limits import check_fits

if TYPE_CHECKING:
    from services.master.service import Master

log = logging.getLogger(__name__)
#: How often the master looks at every tenant's queued jobs besides the wake-ups.
ADMIT_SWEEP_S = 5.0
#: Tries to start a queued job that fails with an error of ours before the job fails.
UNEXPECTED_TRIES = 3


class Admissions:
    """What the master knows of its queued jobs, and the loop that starts them."""

    def __init__(self, master: Master) -> None:
        self.master = master
        #: One admission decision at a time (count what runs, then start or queue).
        self.lock = asyncio.Lock()
        #: Tenants with queued jobs, and those of them whose jobs ended since the last look.
        self.tenants: set[str] = set()
        self.room: set[str] = set()
        self.room_changed = asyncio.Event()
        #: Queued jobs (tenant, job) and when they were accepted: the jobs queue's report.
        self.jobs: dict[tuple[str, str], float] = {}
        #: Failed tries to start a queued job, by (tenant, job) (see :data:`UNEXPECTED_TRIES`).
        self.errors: dict[tuple[str, str], int] = {}

    def noted(self, tenant: str, job_id: str, status: str, created_at: float) -> None:
        """A job entered ``status`` (the master's transitions tell every one)."""
        if status == "queued":
            self.jobs[(tenant, job_id)] = created_at
            self.tenants.add(tenant)
        else:
            self.jobs.pop((tenant, job_id), None)
        if status in TERMINAL_STATUSES:
            self.room.add(tenant)  # its queued jobs may fit now
            self.room_changed.set()

    def queue(self) -> list[TenantQueue]:
        """The jobs waiting for their tenants' limits, per tenant."""
        return per_tenant(((t, since) for (t, _), since in self.jobs.items()), time.time())

    async def find_queued(self) -> None:
        """The queued jobs, from the ``jobs`` KV (a restarted master's start)."""
        queued = [r for r in await list_jobs(self.master.js) if r.status == "queued"]
        self.jobs.update({(r.tenant, r.job_id): r.created_at for r in queued})
        self.tenants |= {r.tenant for r in queued}
        self.room |= self.tenants
        self.room_changed.set()

    async def admit_queued(self, tenant: str) -> None:
        """Start the tenant's queued jobs, oldest first, while its limits leave room (the
        first that must still wait keeps the rest waiting behind it)."""
        master = self.master
        async with self.lock:
            queued = [r for r in await list_jobs(master.js, tenant) if r.status == "queued"]
            try:
                record = await master.gate.record(tenant)
            except PoisonError as exc:  # revoked (or unregistered) while its jobs waited
                for job in queued:
                    await master.transition(tenant, job.job_id, "failed", reason=str(exc))
                self.tenants.discard(tenant)
                return
            limits = record.limits if record is not None else None
            retry = False
            for job in queued:
                try:
                    if not await self._admit(job, limits):
                        return  # it waits, and the younger ones behind it
                except (RetryableError, NatsError, TimeoutError) as exc:
                    # Not the job's fault (the bus, no env worker describing its env yet):
                    # tried again later, and meanwhile it holds up no younger job that can
                    # start (one whose env is described, say).
                    log.warning("admitting %s/%s: %s; trying again", tenant, job.job_id, exc)
                    retry = True
                    continue
                except PoisonError as exc:  # what it points at changed while it waited
                    await master.transition(tenant, job.job_id, "failed", reason=str(exc))
                except Exception as exc:
                    # A bug of ours on this job's data must not stop the master (and every
                    # tenant's admissions with it, at every restart): like the consume
                    # loop's, retried a few times and then the job's failure.
                    key = (tenant, job.job_id)
                    self.errors[key] = tries = self.errors.get(key, 0) + 1
                    log.exception("admitting %s/%s failed (try %d)", tenant, job.job_id, tries)
                    if tries < UNEXPECTED_TRIES:
                        self.room.add(tenant)
                        return
                    reason = f"could not be started: {type(exc).__name__}: {exc}"
                    await master.transition(tenant, job.job_id, "failed", reason=reason)
                self.errors.pop((tenant, job.job_id), None)
            if retry:
                self.room.add(tenant)  # at the next wake-up or sweep
                return
            self.tenants.discard(tenant)

    async def _admit(self, job: JobRecord, limits: TenantLimits | None) -> bool:
        """Start the queued ``job`` if its tenant's ``limits`` leave room; False: it waits."""
        master = self.master
        spec = parse_job_spec(job.spec_json)
        if limits is not None:
            try:
                check_fits(spec, limits)
            except PoisonError as exc:
                # Its tenant's limits were lowered while it waited: it would wait for ever,
                # and every younger job of the tenant behind it.
                raise PoisonError(f"{exc} (the tenant's limits changed while it waited)") from exc
            wait = await master.gate.wait_reason(job.tenant, job.job_id, spec, limits)
            if wait:
                if wait != job.reason:
                    await master.transition(job.tenant, job.job_id, "queued", reason=wait)
                return False
        plan = await master.compile(job.job_id, spec, limits)
        log.info("admitting queued %s/%s", job.tenant, job.job_id)
        await master.begin(job.job_id, spec, plan)
        return True

    async def run(self, stop: asyncio.Event, every_s: float = ADMIT_SWEEP_S) -> None:
        """Admit queued jobs as room appears, and every ``every_s`` for all tenants with
        queued jobs; until ``stop``."""
        await self.find_queued()
        last_sweep = time.monotonic()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.room_changed.wait(), every_s / 4)
            self.room_changed.clear()
            if time.monotonic() - last_sweep >= every_s:
                self.room |= self.tenants
                last_sweep = time.monotonic()
            tenants, self.room = self.room & self.tenants, set()
            for tenant in sorted(tenants):
                try:
                    await self.admit_queued(tenant)
                except (HandlerError, NatsError, TimeoutError) as exc:
                    log.warning("admitting %s's queued jobs failed: %s", tenant, exc)
                    self.room.add(tenant)  # tried again at the next wake-up or sweep
