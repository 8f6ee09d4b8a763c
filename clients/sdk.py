"""The tenant SDK: submit jobs and follow them over the bus.

```python
client = await Client.connect("nats://127.0.0.1:4222", creds="alice.creds")
await client.push_dataset("alice", "data/reach2d", "reach2d")   # into alice's namespace
job = await client.train_sft(spec)          # spec says dataset: reach2d
async for event in job.events():            # accepted, progress, policy, state, ...
    print(event)
result = await job.wait()                   # final status, metrics, policy version
await client.export_policy("alice", job.job_id, out_dir="out")
```

A tenant's identity has no JetStream at all (:mod:`schemas.tenantctl` says why): submits and
cancels, job records, events, dataset uploads, policy downloads and served backbones are all
requests the master answers on ``nexus.ctl.tenant.<tenant>.<op>`` / ``nexus.ctl.backbones``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from opentelemetry.trace import SpanKind
from pydantic import BaseModel

from bus import tracing
from bus.codec import DecodeError, decode, encode
from bus.connect import connect
from bus.envinfo import request_description
from bus.local import read_stack_info
from bus.publish import wire_size
from bus.records import list_jobs
from clients.creds import local_creds, tenant_of_creds
from clients.errors import RequestError
from clients.jobs import Job, JobFailed, JobResult
from clients.push import PushReport, download_export, push_dataset
from schemas import subjects
from schemas.envdesc import EnvDescription
from schemas.ids import validate_id
from schemas.jobs import JobRecord
from schemas.placement import PlacementRecord
from schemas.specs import JobSpec, JobSpecError, parse_job_spec
from schemas.tenantctl import (
    BACKBONES_REPLY_DECODER,
    TENANT_REPLY_DECODER,
    AddDataset,
    Backbones,
    CancelJob,
    CtlError,
    DatasetAdded,
    DatasetRemoved,
    DatasetsReply,
    EventsPage,
    ExportPolicy,
    ExportRemoved,
    GetJob,
    JobRemoved,
    JobReply,
    JobsReply,
    ListDatasets,
    ListJobs,
    PolicyExported,
    ReadEvents,
    RemoveDataset,
    RemoveExport,
    RemoveJob,
    SubmitJob,
    TenantReply,
    TenantRequest,
)
from schemas.tenants import DatasetRecord

__all__ = [
    "Client",
    "Job",
    "JobFailed",
    "JobResult",
    "PushedDataset",
    "RequestError",
    "local_creds",
    "new_job_id",
    "tenant_of_creds",
]

#: A removal reads every job record of the tenant and deletes objects: it may take a while.
REMOVE_TIMEOUT_S = 120.0
#: How long a request waits for the master's answer (a dataset-add downloads and checks).
REQUEST_TIMEOUT_S = 10.0
#: How long a client waits for its broker at connect before it says it cannot reach it.
CONNECT_TIMEOUT_S = 10.0
#: Times a submit is sent when no answer comes (the same job id: a repeat is a no-op).
SUBMIT_ATTEMPTS = 2
DATASET_ADD_TIMEOUT_S = 300.0

T = TypeVar("T")


def _answer(decoder: msgspec.msgpack.Decoder[T], data: bytes, op: str) -> T:
    """The master's reply to ``op``; :class:`RequestError` for one that does not decode or
    is a :class:`~schemas.tenantctl.CtlError`."""
    try:
        answer = decode(decoder, data)
    except DecodeError as exc:
        raise RequestError(
            f"malformed {op} reply: {exc}", code="malformed", retryable=False
        ) from exc
    if isinstance(answer, CtlError):
        raise RequestError(answer.message, code=answer.code, retryable=answer.retryable)
    return answer


def _document(spec: JobSpec | Mapping[str, Any]) -> dict[str, Any]:
    """A spec as the JSON document it is submitted as (a copy: the caller's is not changed);
    :class:`JobSpecError` for one that is not a mapping."""
    if isinstance(spec, BaseModel):
        return spec.model_dump(mode="json")
    if not isinstance(spec, Mapping):
        raise JobSpecError(
            f"a job spec is a mapping (kind: ..., tenant: ...), got {type(spec).__name__}"
        )
    return dict(spec)


def _spec_json(document: Mapping[str, Any]) -> bytes:
    """The document as JSON; :class:`JobSpecError` naming a value JSON has no form for."""
    try:
        return json.dumps(document, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise JobSpecError(f"spec is not plain JSON data: {exc}") from exc


def new_job_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


class Client:
    """A tenant's connection to JoyNexus."""

    def __init__(self, nc: NATS, tenant: str | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        #: The tenant this connection's identity is (None: a service, the operator, or an
        #: open-mode connection); :meth:`jobs` lists its jobs when given no tenant.
        self.tenant = tenant

    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        *,
        creds: str | Path | None = None,
        user: str | None = None,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
        home: str | Path | None = None,
        tenant: str | None = None,
    ) -> Client:
        """Connect to ``url``, or to the local stack started under ``home`` (its stack file
        holds the URL and, with auth on, where the identities' creds files are). Against a
        local stack with auth, the identity is ``creds`` if given, else ``tenant``'s creds
        file (``<creds_dir>/<tenant>.creds``) if it exists, else the operator's."""
        if url is None:
            info = read_stack_info(Path(home or ".joynexus"))
            if info is None:
                raise ConnectionError(
                    f"no bus URL given and no local stack found under {home or '.joynexus'}; "
                    "start one with `joynexus up` or pass --url"
                )
            url = info.url
            if info.auth and creds is None:
                creds = local_creds(Path(info.creds_dir), tenant)
            elif not info.auth:
                user, password = info.user or user, info.password or password
        nc = await connect(
            url,
            name="joynexus-client",
            creds=creds,
            user=user,
            password=password,
            tls=tls,
            first_connect_s=CONNECT_TIMEOUT_S,
        )
        return cls(nc, tenant_of_creds(Path(creds)) if creds is not None else None)

    async def close(self) -> None:
        """Drain the connection (close it, if the broker is away: nothing can drain)."""
        try:
            if self.nc.is_connected:
                await self.nc.drain()
                return
        except NatsError:
            pass
        with contextlib.suppress(NatsError):
            await self.nc.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def submit(self, spec: JobSpec | Mapping[str, Any], *, job_id: str | None = None) -> Job:
        """Validate ``spec`` locally (raising :class:`schemas.specs.JobSpecError` naming the
        bad field) and submit it. Idempotent for the same ``job_id``: a submit that got no
        answer is sent again as it was, and the :class:`RequestError` it may end in names the
        job id to submit again with."""
        document = _document(spec)
        parsed = parse_job_spec(document)
        spec_json = _spec_json(document)
        job_id = validate_id(job_id or new_job_id(parsed.kind), "job id")
        # The job's trace begins here when this process records spans (setup_tracing).
        with tracing.tracer().start_as_current_span(
            "submit",
            kind=SpanKind.CLIENT,
            attributes={
                **tracing.job_attributes(parsed.tenant, job_id),
                "joynexus.kind": parsed.kind,
            },
        ):
            command = SubmitJob(parsed.tenant, job_id, spec_json)
            for attempt in range(1, SUBMIT_ATTEMPTS + 1):
                try:
                    await self.request(parsed.tenant, command)
                    break
                except RequestError as exc:
                    if not exc.retryable or attempt == SUBMIT_ATTEMPTS:
                        raise RequestError(
                            f"submit of job {parsed.tenant}/{job_id}: {exc}"
                            + (
                                f" (submitting it again with job id {job_id!r} is safe: a "
                                "repeat is recognised)"
                                if exc.retryable
                                else ""
                            ),
                            code=exc.code,
                            retryable=exc.retryable,
                        ) from exc
        return Job(self, parsed.tenant, job_id)

    async def train_sft(self, spec: JobSpec | Mapping[str, Any], **kw: Any) -> Job:
        """Submit an SFT job (``kind: sft``)."""
        return await self._submit_kind("sft", spec, **kw)

    async def train_rl(self, spec: JobSpec | Mapping[str, Any], **kw: Any) -> Job:
        """Submit an RL job (``kind: rl``): PPO/GRPO on the tenant's action module in a
        simulator; each iteration's update is a new policy version."""
        return await self._submit_kind("rl", spec, **kw)

    async def evaluate(self, spec: JobSpec | Mapping[str, Any], **kw: Any) -> Job:
        """Submit a read-only evaluation (``kind: eval``) of a fixed policy version."""
        return await self._submit_kind("eval", spec, **kw)

    async def pipeline(self, spec: JobSpec | Mapping[str, Any], **kw: Any) -> Job:
        """Submit stages (e.g. SFT, then RL, then eval) that run one after another, each
        starting from the previous training stage's policy."""
        return await self._submit_kind("pipeline", spec, **kw)

    async def _submit_kind(self, kind: str, spec: JobSpec | Mapping[str, Any], **kw: Any) -> Job:
        document = _document(spec)
        if document.setdefault("kind", kind) != kind:
            raise ValueError(f"expected a spec of kind {kind!r}, got {document['kind']!r}")
        return await self.submit(document, **kw)

    async def cancel(self, tenant: str, job_id: str, reason: str = "") -> None:
        """Cancel one of the tenant's jobs (queued by the master; idempotent)."""
        await self.request(tenant, CancelJob(tenant, job_id, reason))

    async def remove_job(self, tenant: str, job_id: str) -> JobRemoved:
        """Remove one of the tenant's jobs that has ended, with its policy versions, their
        exported copies, its events and its record (a pipeline's stages too). Raises
        :class:`RequestError`: ``not_found`` when there is no such job, ``invalid`` naming
        the jobs while it (or a job that starts from it or evaluates it) has not ended."""
        reply = await self.request(tenant, RemoveJob(tenant, job_id), timeout=REMOVE_TIMEOUT_S)
        assert isinstance(reply, JobRemoved)
        return reply

    async def remove_export(self, tenant: str, job_id: str, version: int = 0) -> ExportRemoved:
        """Delete the exported copy of ``version`` of one of the tenant's jobs (0: every
        exported copy of it) from the tenant's bucket, giving its storage back; the job's
        committed versions stay. Raises :class:`RequestError`: ``not_found`` when there is
        no such copy."""
        reply = await self.request(
            tenant, RemoveExport(tenant, job_id, version), timeout=REMOVE_TIMEOUT_S
        )
        assert isinstance(reply, ExportRemoved)
        return reply

    async def read_events(
        self, request: ReadEvents, timeout: float = REQUEST_TIMEOUT_S
    ) -> EventsPage:
        """One page of a job's events (what :class:`EventFollower` asks for)."""
        reply = await self.request(request.tenant, request, timeout=timeout)
        assert isinstance(reply, EventsPage)
        return reply

    async def describe_env(
        self,
        env_id: str,
        env_kwargs: Mapping[str, float | int | str | bool] | None = None,
        *,
        image_size: int = 64,
        timeout: float = 30.0,
    ) -> EnvDescription:
        """What ``env_id`` (built with ``env_kwargs``) looks like to a head: action space,
        proprio layout and dim, cameras, episode limit, instruction. An env worker answers;
        raises :class:`bus.envinfo.EnvDescribeError` (an unknown id names the supported ones;
        ``retryable`` when no worker answered within ``timeout``)."""
        return await request_description(
            self.nc,
            env_id,
            dict(env_kwargs or {}),
            image_size=image_size,
            timeout=timeout,
            tenant=self.tenant,
        )

    async def request(
        self, tenant: str, request: TenantRequest, *, timeout: float | None = None
    ) -> TenantReply:
        """Send one of the tenant's requests to the master; raise :class:`RequestError` for
        an error reply or when no master answers within ``timeout`` (default
        :data:`REQUEST_TIMEOUT_S`)."""
        timeout = REQUEST_TIMEOUT_S if timeout is None else timeout
        if self.tenant is not None and tenant != self.tenant:
            # The broker would refuse the publish silently: the request would time out.
            raise RequestError(
                f"this connection is tenant {self.tenant!r}'s; it cannot act for tenant {tenant!r}",
                code="tenant_mismatch",
                retryable=False,
            )
        op = type(request).__struct_config__.tag
        assert isinstance(op, str)
        reply = await self._ask(subjects.tenant_ctl(tenant, op), encode(request), timeout)
        return _answer(TENANT_REPLY_DECODER, reply, op)

    async def _ask(self, subject: str, data: bytes, timeout: float) -> bytes:
        """One request, asked again while no master is subscribed (one may be starting or
        restarting) until ``timeout`` has passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        sent_headers = tracing.inject()
        if wire_size(data, sent_headers) > self.nc.max_payload:
            raise RequestError(
                f"request of {wire_size(data, sent_headers)} bytes (payload and headers) is "
                f"over the server's max_payload ({self.nc.max_payload}): send less at once",
                code="invalid",
                retryable=False,
            )
        while True:
            remaining = deadline - loop.time()
            try:
                msg = await self.nc.request(
                    subject, data, timeout=max(remaining, 0.01), headers=sent_headers
                )
                return bytes(msg.data)
            except NoRespondersError as exc:
                if loop.time() + 0.2 >= deadline:
                    raise RequestError(
                        f"no master answered {subject} within {timeout:g}s (is it running?)",
                        code="no_master",
                        retryable=True,
                    ) from exc
                await asyncio.sleep(0.2)
            except (NatsTimeoutError, TimeoutError) as exc:
                raise RequestError(
                    f"no answer on {subject} within {timeout:g}s (is it your tenant's subject?)",
                    code="no_master",
                    retryable=True,
                ) from exc

    async def status(self, tenant: str, job_id: str) -> JobRecord | None:
        """The job's record (None if the master has not recorded it), asked of the master."""
        try:
            reply = await self.request(tenant, GetJob(tenant, job_id))
        except RequestError as exc:
            if exc.code == "not_found":
                return None
            raise
        assert isinstance(reply, JobReply)
        return reply.record

    async def backbones(self) -> list[PlacementRecord]:
        """What is served now: one record per live trainer or inferencer instance, with
        the backbone's id, architecture, parameter count, image size and token budget."""
        data = await self._ask(subjects.backbones_query(self.tenant), b"", REQUEST_TIMEOUT_S)
        reply = _answer(BACKBONES_REPLY_DECODER, data, "backbones")
        assert isinstance(reply, Backbones)
        return reply.placements

    async def jobs(self, tenant: str | None = None) -> list[JobRecord]:
        """The tenant's job records, oldest first. Without ``tenant``: this connection's
        tenant's, or (a service or operator identity, or open mode) every tenant's, read from
        the ``jobs`` KV (which a tenant's identity may not read)."""
        tenant = tenant or self.tenant
        if tenant is None:
            return await list_jobs(self.js)
        records: list[JobRecord] = []
        after = ""
        while True:
            reply = await self.request(tenant, ListJobs(tenant, after))
            assert isinstance(reply, JobsReply)
            records += reply.records
            if not reply.next_after or not reply.records:
                return sorted(records, key=lambda r: r.created_at)
            after = reply.next_after

    async def datasets(self, tenant: str) -> list[DatasetRecord]:
        """The datasets in the tenant's namespace (pushed or registered by the operator)."""
        reply = await self.request(tenant, ListDatasets(tenant))
        assert isinstance(reply, DatasetsReply)
        return reply.records

    async def remove_dataset(self, tenant: str, dataset_id: str) -> DatasetRemoved:
        """Remove a dataset from the tenant's namespace: its record and its stored files
        (the tenant's storage given back). Raises :class:`RequestError`: ``not_found`` when
        there is no such dataset, ``invalid`` naming the jobs that have not ended and name
        it."""
        reply = await self.request(
            tenant, RemoveDataset(tenant, dataset_id), timeout=REMOVE_TIMEOUT_S
        )
        assert isinstance(reply, DatasetRemoved)
        return reply

    async def push_dataset(
        self,
        tenant: str,
        directory: str | Path,
        dataset_id: str,
        *,
        on_file: Callable[[str], None] | None = None,
    ) -> PushedDataset:
        """Upload a dataset directory into the tenant's namespace through the master (which
        stores it in the tenant's bucket; files already there with the same SHA-256 are
        skipped, so an interrupted push resumes) and add it: the master verifies every file
        and checks the dataset, and a spec can then name it as ``dataset: <dataset_id>``.
        Raises :class:`RequestError` naming the bad file (or the tenant's storage limit), or
        :class:`bus.datasets.DatasetStoreError` for a directory it cannot push."""

        async def ask(request: TenantRequest, timeout: float) -> TenantReply:
            return await self.request(tenant, request, timeout=timeout)

        report = await push_dataset(ask, tenant, directory, dataset_id, on_file=on_file)
        reply = await self.request(
            tenant, AddDataset(tenant, dataset_id, report.files), timeout=DATASET_ADD_TIMEOUT_S
        )
        assert isinstance(reply, DatasetAdded)
        report.manifest_sha256 = reply.record.digest  # the manifest the master wrote
        return PushedDataset(report, reply.record)

    async def export_policy(
        self, tenant: str, job_id: str, version: int = 0, out_dir: str | Path = "."
    ) -> Path:
        """Download a committed policy version (0 = the latest) of one of the tenant's jobs
        into ``out_dir`` as ``<job>-v<version>.ckpt`` (a :class:`vla.slot.TenantSlot`
        checkpoint), verified against the checkpoint's SHA-256; returns the file. The master
        copies it into the tenant's bucket and serves it in parts (a tenant's identity has no
        JetStream to read the bucket itself)."""
        reply = await self.request(tenant, ExportPolicy(tenant, job_id, version), timeout=60.0)
        assert isinstance(reply, PolicyExported)

        async def ask(request: TenantRequest, timeout: float) -> TenantReply:
            return await self.request(tenant, request, timeout=timeout)

        return await download_export(ask, tenant, job_id, reply, Path(out_dir))


@dataclass
class PushedDataset:
    """What :meth:`Client.push_dataset` did (files uploaded and skipped) and the record of
    the dataset now in the tenant's namespace."""

    report: PushReport
    record: DatasetRecord
