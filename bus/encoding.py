"""Features from the backbone role, for a trainer or inferencer that holds only heads
(``joynexus up --backbone-service``).

:class:`FeatureClient` sends one :class:`~schemas.feature.EncodeRequest` on
:func:`schemas.subjects.features_encode`, answered by one backbone instance of the queue
group with a :class:`~schemas.feature.FeatureRecord`. Requests and answers too big for one
message travel through the backbone's feature bucket (:func:`bus.features.pack_transient`).
:class:`vla.wire.WireEncoder` turns it into a feature encoder (and checks each record against
the backbone, layer and preprocessing asked for before a head sees it).

:meth:`FeatureClient.request_sync` is for the grouped step, which runs in a worker thread: the
request itself runs on the service's event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.js import JetStreamContext

from bus.codec import DecodeError, decode
from bus.errors import PoisonError, RetryableError
from bus.features import FeatureTransportError, pack_transient, take_blob, unpack
from schemas import subjects
from schemas.feature import (
    ENCODE_REPLY_DECODER,
    FEATURE_RECORD_DECODER,
    BlobRef,
    EncodeError,
    EncodeRequest,
    FeatureRecord,
    FeatureRef,
)

#: After a request found no backbone, the next ones fail at once for this long (the grouped
#: step retries a failed forward once per tenant; each would wait for nothing).
UNAVAILABLE_GRACE_S = 1.0


class BackboneUnavailable(RetryableError):
    """No backbone instance answered (none running, or busy past the timeout): the work that
    needed the features is handed back to be retried."""


class EncodeRefused(PoisonError):
    """The backbone refused the request (another backbone, layer or preprocessing; a bad
    tensor), or its answer was not the features asked for: retrying cannot help."""


class FeatureClient:
    """Asks the backbone role serving ``backbone_id`` for features."""

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        loop: asyncio.AbstractEventLoop,
        backbone_id: str,
        *,
        timeout_s: float = 30.0,
    ) -> None:
        self.nc = nc
        self.js = js
        self.loop = loop
        self.backbone_id = backbone_id
        self.timeout_s = timeout_s
        self.subject = subjects.features_encode(backbone_id)
        #: Requests answered, their samples, and seconds spent waiting for answers.
        self.requests = 0
        self.samples = 0
        self.wait_s = 0.0
        self._unavailable_until = 0.0

    def request_sync(self, request: EncodeRequest) -> FeatureRecord:
        """:meth:`request` from a worker thread (never the loop's own: it would deadlock)."""
        if threading.get_ident() == getattr(self.loop, "_thread_id", None):
            raise RuntimeError("FeatureClient.request_sync blocks: call it from a worker thread")
        future = asyncio.run_coroutine_threadsafe(self.request(request), self.loop)
        return future.result(self.timeout_s * 3)

    async def request(self, request: EncodeRequest) -> FeatureRecord:
        """The backbone's record for ``request`` (not yet checked against it).
        Raises :class:`BackboneUnavailable` (retryable) or :class:`EncodeRefused`."""
        if time.monotonic() < self._unavailable_until:
            raise BackboneUnavailable(f"no backbone instance serves {self.backbone_id!r}")
        data = await pack_transient(self.js, request, self.backbone_id, self.nc.max_payload)
        t0 = time.perf_counter()
        try:
            msg = await self.nc.request(self.subject, data, timeout=self.timeout_s)
        except NoRespondersError as exc:
            self._unavailable_until = time.monotonic() + UNAVAILABLE_GRACE_S
            raise BackboneUnavailable(
                f"no backbone instance serves {self.backbone_id!r} (start one with "
                "`joynexus up --backbone-service` or `python -m services.backbone`)"
            ) from exc
        except TimeoutError as exc:
            raise BackboneUnavailable(
                f"backbone {self.backbone_id!r} did not answer within {self.timeout_s:g} s"
            ) from exc
        finally:
            self.wait_s += time.perf_counter() - t0
        record = await self._record(msg.data)
        if record.sample_ids != request.sample_ids:
            raise EncodeRefused("the backbone's answer covers other samples than asked for")
        self.requests += 1
        self.samples += len(request.sample_ids)
        return record

    async def _record(self, data: bytes) -> FeatureRecord:
        try:
            reply = decode(ENCODE_REPLY_DECODER, data)
            if isinstance(reply, EncodeError):
                error = BackboneUnavailable if reply.retryable else EncodeRefused
                raise error(f"backbone {self.backbone_id!r}: {reply.message}")
            if isinstance(reply, BlobRef):
                return decode(
                    FEATURE_RECORD_DECODER, await take_blob(self.js, reply, self.backbone_id)
                )
            if isinstance(reply, FeatureRef):
                return await unpack(self.js, data)
            return reply
        except (DecodeError, FeatureTransportError) as exc:
            raise EncodeRefused(f"backbone {self.backbone_id!r}'s answer: {exc}") from exc

    def gauges(self) -> dict[str, float]:
        return {
            "remote_encode_requests": float(self.requests),
            "remote_encode_samples": float(self.samples),
            "remote_encode_wait_s": self.wait_s,
        }
