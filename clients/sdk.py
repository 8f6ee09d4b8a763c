"""The tenant SDK: submit jobs and follow them over the bus.

```python
client = await Client.connect("nats://127.0.0.1:4222", user=..., password=...)
job = await client.train_sft(spec)          # validated locally, then by the master
async for event in job.events():            # accepted, progress, policy, state, ...
    print(event)
result = await job.wait()                   # final status, metrics, policy version
```
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from pydantic import BaseModel

from bus.codec import decode
from bus.connect import connect
from bus.envinfo import request_description
from bus.local import read_stack_info
from bus.placement import live_placements
from bus.publish import msg_id, publish
from bus.records import get_job, list_jobs
from schemas import headers, subjects
from schemas.envdesc import EnvDescription
from schemas.events import (
    EVENT_DECODER,
    Event,
    Metrics,
    PolicyPublished,
    Progress,
    Rejected,
    StateChanged,
)
from schemas.ids import validate_id
from schemas.jobs import TERMINAL_STATUSES, JobCancel, JobRecord, JobSubmit
from schemas.placement import PlacementRecord
from schemas.specs import JobSpec, parse_job_spec


class JobFailed(RuntimeError):
    """The job was rejected, failed or was cancelled; ``result`` says how."""

    def __init__(self, result: JobResult) -> None:
        super().__init__(f"job {result.tenant}/{result.job_id} {result.status}: {result.reason}")
        self.result = result


@dataclass
class JobResult:
    """How a job ended."""

    tenant: str
    job_id: str
    status: str
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    policy_version: int = 0


def new_job_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


class Job:
    """A submitted job: its events and its outcome."""

    def __init__(self, client: Client, tenant: str, job_id: str) -> None:
        self.client = client
        self.tenant = tenant
        self.job_id = job_id

    async def events(self, idle_timeout: float | None = None) -> AsyncIterator[Event]:
        """All of the job's events from the first, in order, until it ends (terminal state
        or rejection). ``idle_timeout`` bounds the wait for each next event."""
        sub = await self.client.js.subscribe(
            subjects.events_of_job(self.tenant, self.job_id),
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=idle_timeout or 3600.0)
                except NatsTimeoutError as exc:
                    raise TimeoutError(
                        f"no event from job {self.job_id} in {idle_timeout}s"
                    ) from exc
                event = decode(EVENT_DECODER, msg.data)
                yield event
                if isinstance(event, Rejected) or (
                    isinstance(event, StateChanged) and event.status in TERMINAL_STATUSES
                ):
                    return
        finally:
            await sub.unsubscribe()

    async def wait(self, timeout: float | None = None) -> JobResult:
        """Wait for the end; return the result if it succeeded, else raise :class:`JobFailed`."""

        async def follow() -> JobResult:
            result = JobResult(self.tenant, self.job_id, "unknown")
            async for event in self.events():
                match event:
                    case Progress():
                        result.metrics = dict(event.metrics)
                    case Metrics():
                        result.metrics = dict(event.metrics)
                    case PolicyPublished():
                        result.policy_version = event.version
                    case Rejected():
                        result.status, result.reason = "rejected", event.reason
                    case StateChanged():
                        result.status, result.reason = event.status, event.reason
            record = await self.client.status(self.tenant, self.job_id)
            if record is not None:
                result.metrics = dict(record.metrics) or result.metrics
                result.policy_version = record.policy_version or result.policy_version
            return result

        result = await asyncio.wait_for(follow(), timeout)
        if result.status != "succeeded":
            raise JobFailed(result)
        return result

    async def cancel(self, reason: str = "") -> None:
        await self.client.cancel(self.tenant, self.job_id, reason)


class Client:
    """A tenant's connection to JoyNexus."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()

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
    ) -> Client:
        """Connect to ``url``, or to the local stack started under ``home`` (its stack file
        holds the URL and credentials)."""
        if url is None:
            info = read_stack_info(Path(home or ".joynexus"))
            if info is None:
                raise ConnectionError(
                    f"no bus URL given and no local stack found under {home or '.joynexus'}; "
                    "start one with `joynexus up` or pass --url"
                )
            url, user, password = info.url, info.user, info.password
        return cls(
            await connect(
                url, name="joynexus-client", creds=creds, user=user, password=password, tls=tls
            )
        )

    async def close(self) -> None:
        await self.nc.drain()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def submit(self, spec: JobSpec | Mapping[str, Any], *, job_id: str | None = None) -> Job:
        """Validate ``spec`` locally (raising :class:`schemas.specs.JobSpecError` naming the
        bad field) and submit it. Idempotent for the same ``job_id``."""
        document = spec.model_dump(mode="json") if isinstance(spec, BaseModel) else dict(spec)
        parsed = parse_job_spec(document)
        job_id = validate_id(job_id or new_job_id(parsed.kind), "job id")
        command = JobSubmit(parsed.tenant, job_id, json.dumps(document).encode(), time.time())
        await publish(
            self.js,
            subjects.job(parsed.tenant, "submit"),
            command,
            message_id=msg_id("submit", parsed.tenant, job_id),
            headers={headers.JOB_ID: job_id},
        )
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
        document = spec.model_dump(mode="json") if isinstance(spec, BaseModel) else dict(spec)
        if document.setdefault("kind", kind) != kind:
            raise ValueError(f"expected a spec of kind {kind!r}, got {document['kind']!r}")
        return await self.submit(document, **kw)

    async def cancel(self, tenant: str, job_id: str, reason: str = "") -> None:
        await publish(
            self.js,
            subjects.job(tenant, "cancel"),
            JobCancel(tenant, job_id, reason),
            message_id=msg_id("cancel", tenant, job_id),
            headers={headers.JOB_ID: job_id},
        )

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
            self.nc, env_id, dict(env_kwargs or {}), image_size=image_size, timeout=timeout
        )

    async def status(self, tenant: str, job_id: str) -> JobRecord | None:
        """The job's record in the ``jobs`` KV (None if the master has not recorded it)."""
        record, _ = await get_job(await self.js.key_value(subjects.KV_JOBS), tenant, job_id)
        return record

    async def backbones(self) -> list[PlacementRecord]:
        """What is served now: one record per live trainer or inferencer instance, with
        the backbone's id, architecture, parameter count, image size and token budget."""
        return await live_placements(self.js)

    async def jobs(self, tenant: str | None = None) -> list[JobRecord]:
        """All job records (of ``tenant`` if given), oldest first."""
        return await list_jobs(self.js, tenant)
