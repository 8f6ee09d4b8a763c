"""The master's answers to tenants' requests: ``nexus.ctl.tenant.<tenant>.<op>`` and
``nexus.ctl.backbones[.<tenant>]`` (core NATS request-reply, queue group ``master``).

A tenant's identity has no JetStream (:mod:`schemas.tenantctl` says why), so everything it
does goes through here, answered only on its own inbox. Every request is answered, whatever
is wrong with it: a payload that does not decode, a tag that is not the subject's op or a
tenant that is not the subject's gets a :class:`~schemas.tenantctl.CtlError` naming the
problem, and nothing is read or written for it. The sender is the subject's tenant (the
broker lets a tenant publish only under its own token); the tenant a message claims is
checked against it, never trusted.

* ``job`` / ``jobs``: the tenant's records from the ``jobs`` KV.
* ``submit`` / ``cancel``: queued on ``JOBS`` for the tenant, ``events``: a page of a job's
  events (:mod:`services.master.tenantjobs`).
* ``datasets``: its :class:`~schemas.tenants.DatasetRecord` s.
* ``dataset-plan`` / ``dataset-part``: a push, file by file in parts, into the tenant's
  bucket (:mod:`services.master.transfer`); ``dataset-add``: the master writes the manifest,
  downloads every file into its cache verifying each SHA-256
  (:func:`bus.datasets.materialise`), checks the files as a dataset
  (:func:`vla.data.check_dataset`) and writes the record. Errors name the bad file.
* ``call`` / ``lease`` / ``act``: a low-level session's calls queued on ``TRAIN``, its lease,
  and actions from a policy relayed through ``INFER`` (:mod:`services.master.sessions`).
* ``export``: copies a committed policy version of the tenant's own job from the
  ``checkpoints`` store into the tenant's bucket as ``policies/<job>/v<version>``;
  ``export-read`` returns it in parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from opentelemetry.trace import SpanKind, StatusCode

from bus import tracing
from bus.auth import query_reply_allowed, reply_allowed
from bus.codec import DecodeError, decode, encode
from bus.datacache import DatasetCache
from bus.datasets import (
    DatasetStoreError,
    list_datasets,
    materialise,
    prefix_of,
    put_dataset,
)
from bus.errors import PoisonError
from bus.kv import kv_keys
from bus.placement import live_placements
from bus.records import get_job
from schemas import subjects
from schemas.ids import InvalidIdError, validate_id
from schemas.jobs import JobRecord
from schemas.limits import InputLimits
from schemas.tenantctl import (
    BACKBONES_QUERY_DECODER,
    TENANT_REQUEST_DECODER,
    AddDataset,
    Backbones,
    BackbonesReply,
    CallSession,
    CancelJob,
    CtlError,
    DatasetAdded,
    DatasetsReply,
    ExportPolicy,
    GetJob,
    JobReply,
    JobsReply,
    ListDatasets,
    ListJobs,
    PlanDataset,
    PutDatasetPart,
    Queued,
    ReadEvents,
    ReadExport,
    RemoveDataset,
    RemoveExport,
    RemoveJob,
    RenewLease,
    SamplePolicy,
    SubmitJob,
    TenantReply,
    TenantRequest,
)
from schemas.tenants import DatasetRecord
from services.master.exports import export_policy
from services.master.limits import TenantGate
from services.master.pacing import DEFAULT_BURST, DEFAULT_RATE, Pacer
from services.master.removal import Removal
from services.master.sessions import Sessions
from services.master.tenantjobs import TenantJobs
from services.master.transfer import Transfer
from vla.data import DatasetError, check_dataset, read_meta
from vla.data.limits import dataset_violation

log = logging.getLogger(__name__)

#: Requests that move a dataset's or a policy's bytes, answered HEAVY_CONCURRENCY at a time;
#: the others (records, submits, event pages) have LIGHT_CONCURRENCY slots of their own, so
#: no pile of uploads holds up a submit.
HEAVY_OPS = frozenset(
    {
        "dataset-plan",
        "dataset-part",
        "dataset-add",
        "dataset-rm",
        "job-rm",
        "export",
        "export-rm",
        "export-read",
    }
)
HEAVY_CONCURRENCY = 4
#: Requests that wait on another service for their answer (an act waits for an inferencer,
#: up to its timeout) have slots of their own too: a tenant's slow acts never hold the
#: others' status queries.
WAITING_OPS = frozenset({"act"})
WAITING_CONCURRENCY = 16
LIGHT_CONCURRENCY = 16
#: Slots per kind of request.
POOLS = {"heavy": HEAVY_CONCURRENCY, "waiting": WAITING_CONCURRENCY, "light": LIGHT_CONCURRENCY}
#: The part of each kind's slots one tenant may hold at once: the rest stay for the others.
TENANT_SHARE = 0.5
#: A tenant's requests running or waiting at once; past it, more are refused at once
#: (retryable), without keeping their payloads.
MAX_IN_FLIGHT_PER_TENANT = 16


class Queries:
    """Answers tenants' requests for the master (state lives in the bus, not here)."""

    def __init__(
        self,
        js: JetStreamContext,
        jobs: KeyValue,
        policies: KeyValue,
        cache: DatasetCache,
        *,
        limits: InputLimits | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.js = js
        self.jobs = jobs
        self.policies = policies
        self.cache = cache
        #: The operator's bounds a pushed dataset is held to before its frames are read.
        self.limits = limits or InputLimits()
        self.gate = TenantGate(js)
        self.tenant_jobs = TenantJobs(js)
        self.transfer = Transfer(js, self.gate)
        self.removal = Removal(js, jobs, policies)
        self.sessions = Sessions(js, jobs, self.tenant_jobs, limits)
        self.pacer = pacer or Pacer(DEFAULT_RATE, DEFAULT_BURST)
        self._stop = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self._subs: list[Subscription] = []
        self._replies: set[asyncio.Task[None]] = set()
        self._pools = {pool: asyncio.Semaphore(size) for pool, size in POOLS.items()}
        #: Each tenant's share of each pool, made on its first request of that kind.
        self._shares: dict[tuple[str, str], asyncio.Semaphore] = {}
        self._in_flight: Counter[str] = Counter()
        self._max_payload = 1 << 20

    @classmethod
    async def on_bus(cls, js: JetStreamContext, cache: DatasetCache) -> Queries:
        """Responders over the bus's ``jobs`` and ``policies`` KV (declared beforehand)."""
        jobs = await js.key_value(subjects.KV_JOBS)
        return cls(js, jobs, await js.key_value(subjects.KV_POLICIES), cache)

    # -- dispatch ---------------------------------------------------------------------------

    async def answer(self, subject: str, data: bytes) -> TenantReply:
        """The reply to one request on ``subject``; every failure becomes a CtlError."""
        try:
            subject_tenant, op = subjects.parse_tenant_ctl(subject)
        except subjects.SubjectError as exc:
            return CtlError("malformed", str(exc))
        try:
            request = decode(TENANT_REQUEST_DECODER, data)
        except DecodeError as exc:
            return CtlError("malformed", f"malformed {op} request: {exc}")
        tag = type(request).__struct_config__.tag
        if tag != op:
            return CtlError("malformed", f"a {tag!r} request was sent on the {op!r} subject")
        if request.tenant != subject_tenant:
            return CtlError(
                "tenant_mismatch",
                f"tenant: request for tenant {request.tenant!r} sent on tenant "
                f"{subject_tenant!r}'s subject",
            )
        refusal = await self.refusal(subject_tenant)
        if refusal is not None:
            return refusal
        try:
            return await self.apply(request)
        except DatasetStoreError as exc:
            return CtlError(exc.code, str(exc), exc.retryable)  # type: ignore[arg-type]
        except InvalidIdError as exc:
            return CtlError("invalid", str(exc))
        except PoisonError as exc:  # e.g. a call too big to queue once the headers are on
            return CtlError("invalid", f"{op}: {exc}")
        except (NatsError, TimeoutError) as exc:
            return CtlError("unavailable", f"{op}: the bus did not answer: {exc}", True)

    async def refusal(self, tenant: str) -> CtlError | None:
        """With registered tenants (any record in ``tenants``), only a registered, unrevoked
        one is answered; in open mode (none registered) every tenant is. The same check as
        the master's at submit (:class:`services.master.limits.TenantGate`)."""
        try:
            await self.gate.record(tenant)
        except PoisonError as exc:
            return CtlError("unknown_tenant", str(exc))
        return None

    async def apply(self, request: TenantRequest) -> TenantReply:
        match request:
            case GetJob():
                validate_id(request.job_id, "job id")
                record, _ = await get_job(self.jobs, request.tenant, request.job_id)
                if record is None:
                    return CtlError(
                        "not_found", f"no job {request.job_id!r} of tenant {request.tenant}"
                    )
                return JobReply(record)
            case ListJobs():
                return await self.jobs_page(request)
            case ListDatasets():
                return DatasetsReply(await list_datasets(self.js, request.tenant))
            case AddDataset():
                async with self.removal.lock(request.tenant, "dataset", request.dataset):
                    return await self.add_dataset(request)
            case RemoveDataset():
                async with self.removal.lock(request.tenant, "dataset", request.dataset):
                    return await self.removal.dataset(request)
            case RemoveJob():
                async with await self.removal.job_lock(request.tenant, request.job_id):
                    return await self.removal.job(request)
            case ExportPolicy():
                # Not copied into the bucket after a removal of the job cleared it.
                async with await self.removal.job_lock(request.tenant, request.job_id):
                    return await export_policy(self.js, self.policies, self.transfer, request)
            case RemoveExport():
                async with await self.removal.job_lock(request.tenant, request.job_id):
                    return await self.removal.export(request)
            case SubmitJob() | CancelJob():
                reply = await self.tenant_jobs.command(request)
                if isinstance(request, SubmitJob) and isinstance(reply, Queued):
                    self.sessions.submitted(request)  # (a refused one has no lease to run)
                return reply
            case ReadEvents():
                return await self.tenant_jobs.events(request)
            case PlanDataset():
                return await self.transfer.plan(request)
            case PutDatasetPart():
                return await self.transfer.put_part(request)
            case ReadExport():
                return await self.transfer.read_export(request)
            case CallSession():
                return await self.sessions.call(request)
            case RenewLease():
                return await self.sessions.renew(request)
            case SamplePolicy():
                return await self.sessions.act(request)
        raise AssertionError(f"unhandled request {request!r}")

    # -- datasets ---------------------------------------------------------------------------

    async def add_dataset(self, request: AddDataset) -> TenantReply:
        """Verify a pushed dataset, check it as a dataset, record it in the namespace. With
        ``files`` (the end of a tenant's push) the master first checks that each is stored
        and writes the manifest itself; without, the manifest in the bucket is used."""
        tenant, dataset = request.tenant, validate_id(request.dataset, "dataset id")
        if request.files is not None:
            await self.transfer.write_manifest(request)
        directory, manifest, manifest_digest = await materialise(
            self.js, tenant, dataset, self.cache
        )
        try:
            # Its limits first (metadata only), as a submit does: reading frames of a
            # dataset past them could take the master's memory.
            meta = await asyncio.to_thread(read_meta, directory)
            violation = await asyncio.to_thread(dataset_violation, dataset, meta, self.limits)
            if violation:
                return CtlError("invalid", violation)
            await asyncio.to_thread(check_dataset, directory)
        except DatasetError as exc:
            return CtlError("invalid", f"dataset {dataset!r}: {exc}")
        except OSError as exc:
            return CtlError("invalid", f"dataset {dataset!r}: cannot read it: {exc}")
        record = DatasetRecord(
            tenant=tenant,
            dataset=dataset,
            source="pushed",
            created_at=time.time(),
            bucket=subjects.tenant_bucket(tenant),
            prefix=prefix_of(dataset),
            files=len(manifest.files),
            bytes=manifest.total_bytes,
            digest=manifest_digest,
        )
        await put_dataset(self.js, record)
        log.info("dataset %s/%s added (%d files)", tenant, dataset, record.files)
        return DatasetAdded(record)

    async def jobs_page(self, request: ListJobs) -> TenantReply:
        """The tenant's records after job id ``request.after``, as many as fit half a
        message (job records are kept until their tenant removes them: all of them could
        outgrow one); each page reads only its own records."""
        if request.after:
            validate_id(request.after, "after")
        prefix = f"{request.tenant}."
        keys = await kv_keys(self.js, subjects.KV_JOBS, prefix)
        if request.after:
            keys = [k for k in keys if k > prefix + request.after]
        page: list[JobRecord] = []
        size = 0
        last = ""
        for key in keys:
            record, _ = await get_job(self.jobs, request.tenant, key[len(prefix) :])
            if record is None:
                continue  # deleted since the listing
            n = len(encode(record))
            if page and size + n > self.tenant_jobs.page_bytes:
                return JobsReply(page, next_after=last)
            page.append(record)
            size += n
            last = record.job_id
        return JobsReply(page)

    # -- backbones --------------------------------------------------------------------------

    async def backbones(self, data: bytes) -> BackbonesReply:
        """The live placements (an empty or a ``BackbonesQuery`` payload)."""
        if data:
            try:
                decode(BACKBONES_QUERY_DECODER, data)
            except DecodeError as exc:
                return CtlError("malformed", f"malformed backbones request: {exc}")
        try:
            return Backbones(await live_placements(self.js))
        except (NatsError, TimeoutError) as exc:
            return CtlError("unavailable", f"backbones: the bus did not answer: {exc}", True)

    # -- subscription -----------------------------------------------------------------------

    def _share(self, tenant: str, pool: str) -> asyncio.Semaphore:
        key = (tenant, pool)
        if key not in self._shares:
            self._shares[key] = asyncio.Semaphore(max(1, int(POOLS[pool] * TENANT_SHARE)))
        return self._shares[key]

    async def _reply(self, msg: Msg, tenant: str, pool: str, wait_s: float) -> None:
        if wait_s > 0:  # paced: the tenant is over its rate (a stop answers at once)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait_s)
        async with self._share(tenant, pool), self._pools[pool]:
            attributes = {"messaging.system": "nats", "messaging.destination.name": msg.subject}
            with tracing.consumer_span(
                f"answer {msg.subject}", msg.headers, attributes, kind=SpanKind.SERVER
            ) as span:
                try:
                    if msg.subject.startswith(subjects.BACKBONES_QUERY):
                        reply: TenantReply | BackbonesReply = await self.backbones(msg.data)
                    else:
                        reply = await self.answer(msg.subject, msg.data)
                except Exception as exc:  # a bug of ours: the requester still gets an answer
                    log.exception("request on %s failed", msg.subject)
                    reply = CtlError("unavailable", f"internal error: {exc}", True)
                if isinstance(reply, CtlError):
                    span.set_status(StatusCode.ERROR, f"{reply.code}: {reply.message}")
        if not msg.reply:
            return
        if not self._reply_allowed(msg.subject, msg.reply):
            # The broker never checks a request's reply subject: answering there would let
            # a tenant publish, as the master, into another's inbox or onto a stream subject.
            log.warning("dropped the reply to %s: reply subject %r refused", msg.subject, msg.reply)
            return
        await self._respond(msg, reply)

    async def _respond(self, msg: Msg, reply: TenantReply | BackbonesReply) -> None:
        data = encode(reply)
        if len(data) > self._max_payload:
            # Unsent, the requester would time out and ask the same again, forever.
            too_big = CtlError(
                "invalid",
                f"the answer has {len(data)} bytes, more than the server's max_payload "
                f"({self._max_payload}): ask for less (a smaller limit or length)",
            )
            data = encode(too_big)
        try:
            await msg.respond(data)
        except NatsError as exc:  # the connection closed meanwhile: the requester times out
            log.info("reply on %s not sent: %s", msg.subject, exc)

    @staticmethod
    def _reply_allowed(subject: str, reply: str) -> bool:
        """A tenant's request is answered only on its own inbox; the backbones query on the
        inbox of whoever its subject names (a tenant's, or the services' for the bare one)."""
        if subject.startswith(subjects.BACKBONES_QUERY):
            return query_reply_allowed(subject, subjects.BACKBONES_QUERY, reply)
        tokens = subject.split(".")
        try:
            # The tenant's token, whatever the op: a tenant may publish any op under its own
            # subject, and one the master does not know is still that tenant's request.
            tenant = validate_id(tokens[3] if len(tokens) > 3 else "", "tenant")
        except InvalidIdError:
            return reply.startswith("_INBOX.")  # only the operator publishes there
        return reply_allowed(reply, tenant)

    async def _on_request(self, msg: Msg) -> None:
        # The subject's tokens: nexus.ctl.tenant.<tenant>.<op> or nexus.ctl.backbones[.<t>].
        tokens = msg.subject.split(".")
        tenant = tokens[3] if len(tokens) > 3 else ""
        op = tokens[4] if len(tokens) == 5 and tokens[2] == "tenant" else ""
        if self._in_flight[tenant] >= MAX_IN_FLIGHT_PER_TENANT:
            if msg.reply and self._reply_allowed(msg.subject, msg.reply):
                busy = CtlError(
                    "unavailable",
                    f"tenant {tenant}: {MAX_IN_FLIGHT_PER_TENANT} requests are in flight "
                    "already; wait for their answers",
                    True,
                )
                await self._respond(msg, busy)
            return
        self._in_flight[tenant] += 1
        wait_s = self.pacer.reserve(tenant, len(msg.data))
        # One task per request: a dataset-add's download must not hold up a status query.
        pool = "heavy" if op in HEAVY_OPS else "waiting" if op in WAITING_OPS else "light"
        task = asyncio.create_task(self._reply(msg, tenant, pool, wait_s))
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)
        task.add_done_callback(lambda _: self._done(tenant))

    def _done(self, tenant: str) -> None:
        self._in_flight[tenant] -= 1
        if self._in_flight[tenant] <= 0:
            del self._in_flight[tenant]
            for pool in self._pools:  # nothing of the tenant's holds a share now
                self._shares.pop((tenant, pool), None)

    async def subscribe(self, nc: NATS) -> None:
        """Start answering in the master's queue group (one master answers each request)."""
        self._max_payload = nc.max_payload
        self.tenant_jobs.page_bytes = min(self.tenant_jobs.page_bytes, nc.max_payload // 2)
        backbones = subjects.BACKBONES_QUERY
        for subject in (subjects.tenant_ctl_all(), backbones, f"{backbones}.*"):
            self._subs.append(
                await nc.subscribe(subject, queue=subjects.TENANT_CTL_QUEUE, cb=self._on_request)
            )
        self._sweeper = asyncio.create_task(self.sessions.sweep(self._stop))

    async def close(self, timeout: float = 1.0) -> None:
        """Stop answering; replies in progress get ``timeout`` to finish (a requester whose
        reply is dropped times out and asks again)."""
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except NatsError:
                pass
        self._subs.clear()
        self._stop.set()
        if self._replies:
            await asyncio.wait(set(self._replies), timeout=timeout)
        if self._sweeper is not None:
            await asyncio.wait({self._sweeper}, timeout=timeout)
        await self.sessions.close()
