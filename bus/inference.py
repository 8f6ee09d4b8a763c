"""Asking the inferencers for actions: the requester side of the Inference Queue.

Env workers (and anything else that needs a tenant policy's actions) use one
:class:`PolicyClient` per process::

    client = await PolicyClient.create(nc, backbone_id="tiny")
    reply = await client.act("acme", "job-1", [observation(images, "pick the cube", proprio)])
    actions_B_C_A = reply.actions.to_numpy()     # float32 (B, chunk_len, action_dim)
    log_probs_B = reply.log_probs.to_numpy()     # float32 (B,)
    values_B = reply.values.to_numpy() if reply.values is not None else None
    await client.close()

Each call publishes one :class:`~schemas.infer.ActRequest` into ``INFER``
(``nexus.infer.<backbone>.<tenant>``, ``Nats-Msg-Id`` = its request id) and waits for the
:class:`~schemas.infer.ActReply` on a per-process inbox: one wildcard subscription, replies
routed to their waiting call by the last subject token, so a call costs one publish and
no subscription set-up.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Sequence

import numpy as np
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from opentelemetry.trace import SpanKind

from bus import tracing
from bus.codec import DecodeError, decode
from bus.errors import PoisonError
from bus.publish import publish
from bus.records import get_policy
from schemas import subjects
from schemas.infer import ACT_REPLY_DECODER, ActReply, ActRequest
from schemas.model import Observation
from schemas.tensor import Tensor

#: Request ids become the last token of the reply subject.
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class InferenceError(RuntimeError):
    """An act request failed. ``retryable`` is False when the inferencer refused it (the same
    request will fail again: fix the input); True for timeouts and bus failures (asking
    again, with a new request id, may succeed). ``reply`` is the error reply, if any."""

    def __init__(
        self,
        message: str,
        *,
        request_id: str,
        retryable: bool = False,
        reply: ActReply | None = None,
    ) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.retryable = retryable
        self.reply = reply


class InferenceTimeout(InferenceError):
    """No reply within the timeout (no inferencer running, or all of them busy)."""


def observation(
    images: Sequence[np.ndarray], instruction: str, proprio: np.ndarray | None = None
) -> Observation:
    """An :class:`Observation` from numpy: 1-3 uint8 (H, W, 3) views, the instruction and a
    float32 (P,) proprio vector (None: no proprio, P = 0)."""
    state = np.zeros(0, np.float32) if proprio is None else np.asarray(proprio, np.float32)
    return Observation(
        [Tensor.from_numpy(np.asarray(image)) for image in images],
        instruction,
        Tensor.from_numpy(state),
    )


class PolicyClient:
    """Sends act requests for one backbone and awaits their replies. Build with
    :meth:`create`; safe to share between any number of concurrent tasks of one event loop.
    """

    def __init__(self, nc: NATS, js: JetStreamContext, backbone_id: str) -> None:
        self.nc = nc
        self.js = js
        self.backbone_id = subjects.validate_id(backbone_id, "backbone")
        self._inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._waiting: dict[str, asyncio.Future[ActReply]] = {}
        self._policies: KeyValue | None = None
        #: (num_views, token_budget) of each job's policy, read once from its record.
        self._layouts: dict[tuple[str, str], tuple[int, int]] = {}

    @classmethod
    async def create(
        cls, nc: NATS, backbone_id: str, js: JetStreamContext | None = None
    ) -> PolicyClient:
        """A client on connection ``nc`` for policies on backbone ``backbone_id``."""
        client = cls(nc, js or nc.jetstream(), backbone_id)
        client._sub = await nc.subscribe(client._inbox + ".*", cb=client._on_reply)
        return client

    async def close(self) -> None:
        """Stop listening; calls still waiting fail with :class:`InferenceError`."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        for rid, future in self._waiting.items():
            if not future.done():
                future.set_exception(InferenceError("client closed", request_id=rid))
        self._waiting.clear()

    async def __aenter__(self) -> PolicyClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _on_reply(self, msg: Msg) -> None:
        rid = msg.subject[len(self._inbox) + 1 :]  # the subscription is <inbox>.*
        future = self._waiting.pop(rid, None)
        if future is None or future.done():
            return  # a late reply to a call that timed out
        try:
            future.set_result(decode(ACT_REPLY_DECODER, msg.data))
        except DecodeError as exc:
            future.set_exception(InferenceError(f"malformed reply: {exc}", request_id=rid))

    async def layout(self, tenant: str, job_id: str) -> tuple[int, int]:
        """``(num_views, token_budget)`` the job's policy was trained with (cached)."""
        key = (tenant, job_id)
        if key not in self._layouts:
            if self._policies is None:
                self._policies = await self.js.key_value(subjects.KV_POLICIES)
            try:
                record, _ = await get_policy(self._policies, tenant, job_id)
            except DecodeError as exc:
                raise InferenceError(
                    f"unreadable policy record of {tenant}/{job_id}: {exc}", request_id=""
                ) from exc
            if record is None:
                raise InferenceError(
                    f"no committed policy for tenant {tenant!r} job {job_id!r}", request_id=""
                )
            self._layouts[key] = (record.slot.num_views, record.slot.token_budget)
        return self._layouts[key]

    async def act(
        self,
        tenant: str,
        job_id: str,
        observations: Sequence[Observation],
        *,
        policy_version: int = 0,
        deterministic: bool = False,
        seed: int = -1,
        num_views: int | None = None,
        token_budget: int | None = None,
        request_id: str | None = None,
        timeout: float = 10.0,
        priority: int = 1,
    ) -> ActReply:
        """Actions for ``observations`` (one per env session) from a job's policy.

        Args:
            tenant, job_id: whose policy.
            observations: B observations; the reply's arrays have B rows in this order.
            policy_version: 0 = the latest committed version; else that exact version
                (the reply's ``policy_version`` says which one served).
            deterministic: the policy's mode instead of a sample (evaluation).
            seed: >= 0 draws the sampling noise from a generator seeded with it (the same
                seed, version and observations give the same actions); -1 uses the policy's
                own generator.
            num_views, token_budget: the model-facing layout; None (default) = the job's
                own, read once from its ``policies`` record. Others are refused.
            request_id: ``[A-Za-z0-9_-]`` id, also the message's ``Nats-Msg-Id`` (default:
                a fresh uuid). Re-sending an id inside the stream's duplicate window is
                dropped as a duplicate, so a retry after a timeout needs a new one.
            timeout: seconds to wait for the reply.
            priority: the job's weight in shared batches (from its task; 1 = fair share).

        Raises:
            InferenceError: the inferencer refused the request (``reply.error``: unknown
                job, shapes that do not fit the head, ...), or publishing failed.
            InferenceTimeout: no reply in ``timeout`` seconds.
        """
        rid = request_id or uuid.uuid4().hex
        if not _REQUEST_ID_RE.fullmatch(rid):
            raise ValueError(f"request_id {rid!r} must match {_REQUEST_ID_RE.pattern}")
        if num_views is None or token_budget is None:
            views, budget = await self.layout(tenant, job_id)
            num_views = views if num_views is None else num_views
            token_budget = budget if token_budget is None else token_budget
        request = ActRequest(
            tenant,
            job_id,
            rid,
            f"{self._inbox}.{rid}",
            list(observations),
            policy_version=policy_version,
            deterministic=deterministic,
            seed=seed,
            num_views=num_views,
            token_budget=token_budget,
            sent_at=time.time(),
            expires_at=time.time() + timeout,
            priority=max(1, priority),
        )
        if self._sub is None:
            raise InferenceError("client is closed", request_id=rid)
        future: asyncio.Future[ActReply] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future  # before publishing: the reply can beat the PubAck
        deadline = time.monotonic() + timeout
        attributes = {
            **tracing.job_attributes(tenant, job_id),
            "messaging.system": "nats",
            "messaging.destination.name": subjects.infer(self.backbone_id, tenant),
            "messaging.message.id": rid,
            "joynexus.observations": len(request.observations),
        }
        with tracing.tracer().start_as_current_span(
            "act", kind=SpanKind.CLIENT, attributes=attributes
        ):
            try:
                try:
                    await publish(
                        self.js,
                        subjects.infer(self.backbone_id, tenant),
                        request,
                        message_id=rid,
                        timeout=timeout,
                    )
                except NatsError as exc:
                    raise InferenceError(
                        f"cannot publish act request: {exc!r}", request_id=rid, retryable=True
                    ) from exc
                except PoisonError as exc:  # too big to publish at all
                    raise InferenceError(str(exc), request_id=rid) from exc
                try:
                    reply = await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise InferenceTimeout(
                        f"no reply to {rid} for {tenant}/{job_id} within {timeout}s",
                        request_id=rid,
                        retryable=True,
                    ) from None
            finally:
                self._waiting.pop(rid, None)
        if reply.error:
            raise InferenceError(
                reply.error, request_id=rid, retryable=reply.retryable, reply=reply
            )
        return reply
