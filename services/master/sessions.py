"""Low-level sessions, as the master serves them to tenants: calls queued on the Training
Queue, leases, and sampling from a policy through the inferencers.

A tenant's identity has no JetStream (:mod:`schemas.tenantctl` says why), so the master puts
its session calls on ``TRAIN`` for it (subject ``nexus.train.<backbone>.<tenant>``,
``Nats-Msg-Id`` ``call/<tenant>/<session>/<n>``: a repeated call is the same message) and
relays its act requests to ``INFER``. Calls are accepted only for the tenant's own session
while it is open; the trainer applies them in call order and answers each with a ``call``
event.

A session's lease: every call or :class:`~schemas.tenantctl.RenewLease` renews it; a session
silent for its spec's ``lease_s`` is cancelled ("lease expired"), which closes its slot (its
checkpoints remain). A master that starts finds the open sessions in the ``jobs`` KV and gives
each a whole lease from then: a restart can extend a lease, never cut one short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from bus.errors import PoisonError
from bus.inference import InferenceError, InferenceTimeout, PolicyClient
from bus.publish import msg_id, publish
from bus.records import get_job, list_jobs
from schemas import headers, subjects
from schemas.ids import validate_id
from schemas.jobs import TERMINAL_STATUSES, JobRecord
from schemas.limits import InputLimits, exceeds, observation_violation
from schemas.specs import JobSpecError, SessionSpec, parse_job_spec
from schemas.tenantctl import (
    CallSession,
    CancelJob,
    CtlError,
    Leased,
    Queued,
    RenewLease,
    Sampled,
    SamplePolicy,
    SubmitJob,
    TenantReply,
)
from services.master.limits import TenantGate
from services.master.tenantjobs import TenantJobs

log = logging.getLogger(__name__)

#: How often leases are checked.
SWEEP_EVERY_S = 1.0
#: How often the ``jobs`` KV is read for open sessions the master has not seen (submitted
#: by another master replica, or straight onto ``JOBS`` by an operator).
ADOPT_EVERY_S = 30.0
#: The longest an act request may wait for an inferencer.
MAX_ACT_TIMEOUT_S = 60.0


class Sessions:
    """Calls, leases and sampling for tenants' low-level sessions."""

    def __init__(
        self,
        js: JetStreamContext,
        jobs: KeyValue,
        tenant_jobs: TenantJobs,
        limits: InputLimits | None = None,
    ) -> None:
        self.js = js
        #: What an act request's observations are checked against before it is relayed.
        self.limits = limits or InputLimits()
        self.jobs = jobs
        self.tenant_jobs = tenant_jobs
        #: Tenants' records: their priority class weighs their sampling as their rollouts.
        self.gate = TenantGate(js)
        #: (tenant, session) → (monotonic time of its last call or renewal, lease_s).
        self.leases: dict[tuple[str, str], tuple[float, float]] = {}
        self._policy_clients: dict[str, PolicyClient] = {}

    async def _open_session(
        self, tenant: str, job_id: str
    ) -> tuple[JobRecord, SessionSpec] | CtlError:
        job_id = validate_id(job_id, "session id")
        record, _ = await get_job(self.jobs, tenant, job_id)
        if record is None:
            return CtlError("not_found", f"no session {job_id!r} of tenant {tenant}")
        if record.kind != "session":
            return CtlError("invalid", f"job {job_id!r} is a {record.kind} job, not a session")
        if record.status in TERMINAL_STATUSES:
            why = f": {record.reason}" if record.reason else ""
            return CtlError("closed", f"session {job_id!r} is {record.status}{why}")
        spec = parse_job_spec(record.spec_json)
        assert isinstance(spec, SessionSpec)
        self.leases[(tenant, job_id)] = (time.monotonic(), spec.lease_s)
        return record, spec

    async def call(self, request: CallSession) -> TenantReply:
        """Queue one call of the tenant's session (it renews the lease)."""
        call = request.call
        if call.tenant != request.tenant or call.job_id != request.job_id:
            return CtlError(
                "tenant_mismatch",
                f"call: for {call.tenant}/{call.job_id}, sent as {request.tenant}/{request.job_id}",
            )
        if call.call < 0:
            return CtlError("invalid", f"call.call: {call.call} is negative (calls count from 0)")
        opened = await self._open_session(request.tenant, request.job_id)
        if isinstance(opened, CtlError):
            return opened
        _, spec = opened
        if call.call >= spec.max_calls:  # the trainer would hold it, waiting, for ever
            return CtlError(
                "invalid",
                f"call.call: {call.call} is past the session's max_calls {spec.max_calls}",
            )
        ack = await publish(
            self.js,
            subjects.train(spec.backbone, request.tenant),
            call,
            message_id=msg_id("call", request.tenant, request.job_id, call.call),
            headers={headers.JOB_ID: request.job_id},
        )
        await self.js._nc.publish(subjects.train_wake(spec.backbone), b"")
        return Queued(request.job_id, ack.seq, bool(ack.duplicate))

    async def renew(self, request: RenewLease) -> TenantReply:
        opened = await self._open_session(request.tenant, request.job_id)
        if isinstance(opened, CtlError):
            return opened
        return Leased(request.job_id, opened[1].lease_s)

    async def act(self, request: SamplePolicy) -> TenantReply:
        """Actions from a committed version of one of the tenant's policies."""
        job_id = validate_id(request.job_id, "job id")
        if not request.observations:
            return CtlError("invalid", "observations: at least one is needed")
        # What no policy could serve is refused here, before it costs INFER a write and an
        # inferencer a decode (the inferencer checks again, with the policy's own bounds).
        count, most = len(request.observations), self.limits.max_observations
        if count > most:
            return CtlError("invalid", exceeds("observations", count, "max_observations", most))
        for i, obs in enumerate(request.observations):
            violation = observation_violation(f"observations[{i}]", obs, self.limits)
            if violation is not None:
                return CtlError("invalid", f"act: {violation}")
        if not 0.0 < request.timeout_s <= MAX_ACT_TIMEOUT_S:
            return CtlError("invalid", f"timeout_s: {request.timeout_s} is not in (0, 60]")
        record, _ = await get_job(self.jobs, request.tenant, job_id)
        if record is None:
            return CtlError("not_found", f"no job {job_id!r} of tenant {request.tenant}")
        try:
            spec = parse_job_spec(record.spec_json)
        except JobSpecError as exc:  # a record written by an older master, say
            return CtlError("invalid", f"job {job_id!r}: {exc}")
        backbone = getattr(spec, "backbone", None)
        if not isinstance(backbone, str):
            return CtlError("invalid", f"job {job_id!r} is a {record.kind}: it has no policy")
        try:
            tenant = await self.gate.record(request.tenant)
        except PoisonError as exc:  # revoked meanwhile, or its record unreadable
            return CtlError("invalid", f"act: {exc}")
        # Weighed in the inferencer's batches as the job's rollouts are: its tenant's
        # priority class times its own priority (sampling went at weight 1).
        weight = (tenant.limits.weight if tenant is not None else 1) * getattr(spec, "priority", 1)
        client = await self._policy_client(backbone)
        try:
            reply = await client.act(
                request.tenant,
                job_id,
                request.observations,
                policy_version=request.version,
                deterministic=request.deterministic,
                seed=request.seed,
                timeout=request.timeout_s,
                priority=weight,
            )
        except InferenceTimeout as exc:
            return CtlError("unavailable", f"act: no inferencer answered: {exc}", True)
        except InferenceError as exc:  # a refusal, or a transient failure given up on
            if exc.retryable:
                return CtlError("unavailable", f"act: {exc}", True)
            return CtlError("invalid", f"act: {exc}")
        return Sampled(reply)

    async def _policy_client(self, backbone: str) -> PolicyClient:
        if backbone not in self._policy_clients:
            self._policy_clients[backbone] = await PolicyClient.create(
                self.js._nc, backbone, self.js
            )
        return self._policy_clients[backbone]

    # -- leases ------------------------------------------------------------------------------
    def submitted(self, request: SubmitJob) -> None:
        """A tenant submitted a job: a session's lease starts now."""
        try:
            spec = parse_job_spec(request.spec_json)
        except JobSpecError:
            return  # the master rejects it, naming the field
        if isinstance(spec, SessionSpec) and spec.tenant == request.tenant:
            key = (request.tenant, request.job_id)
            self.leases.setdefault(key, (time.monotonic(), spec.lease_s))

    async def adopt_open(self) -> None:
        """Give every open session in the ``jobs`` KV a whole lease from now."""
        now = time.monotonic()
        for record in await list_jobs(self.js):
            if record.kind != "session" or record.status in TERMINAL_STATUSES:
                continue
            try:
                spec = parse_job_spec(record.spec_json)
            except JobSpecError:
                continue
            if isinstance(spec, SessionSpec):
                self.leases.setdefault((record.tenant, record.job_id), (now, spec.lease_s))

    async def expire(self) -> list[tuple[str, str]]:
        """Cancel the sessions whose lease ran out; returns them."""
        now = time.monotonic()
        expired = [k for k, (seen, lease) in self.leases.items() if now - seen > lease]
        for tenant, job_id in expired:
            lease = self.leases[(tenant, job_id)][1]
            reason = f"lease expired: no call or renewal for {lease:g} s"
            try:
                record, _ = await get_job(self.jobs, tenant, job_id)
                if record is None:
                    # Not recorded: rejected (a cancel would be refused as an unknown job,
                    # a second rejection), or still behind other commands on JOBS; then
                    # adopt_open gives it a whole lease once it is recorded.
                    del self.leases[(tenant, job_id)]
                    continue
                if record.status in TERMINAL_STATUSES:
                    del self.leases[(tenant, job_id)]  # closed by its client, or ended
                    continue
                await self.tenant_jobs.command(CancelJob(tenant, job_id, reason))
            except (NatsError, TimeoutError) as exc:
                log.warning("could not close expired session %s/%s: %s", tenant, job_id, exc)
                continue  # tried again next sweep
            log.info("session %s/%s closed: %s", tenant, job_id, reason)
            del self.leases[(tenant, job_id)]
        return expired

    async def sweep(self, stop: asyncio.Event) -> None:
        """Expire leases every :data:`SWEEP_EVERY_S` until ``stop``."""
        adopted = -math.inf
        while not stop.is_set():
            if time.monotonic() - adopted > ADOPT_EVERY_S:
                with contextlib.suppress(NatsError, TimeoutError):
                    await self.adopt_open()
                    adopted = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SWEEP_EVERY_S)
            if not stop.is_set():
                await self.expire()

    async def close(self) -> None:
        for client in self._policy_clients.values():
            await client.close()
        self._policy_clients.clear()
