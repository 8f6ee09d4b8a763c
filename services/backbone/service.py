"""The backbone role: one resident frozen backbone, encoding for trainers and inferencers that
hold only heads (their ``--backbone-service``).

It answers :class:`~schemas.feature.EncodeRequest` on ``nexus.features.<backbone>.encode``
(core NATS request-reply, queue group ``backbone-<backbone>``: scale out by starting more).
Requests that arrived while a forward ran are grouped: one forward per compatibility key over
all of them (:func:`vla.grouping.encode_each`), each answered with the
:class:`~schemas.feature.FeatureRecord` of its own samples. Nothing here is durable: a
requester whose answer does not come retries its own work (the trainer hands the round's
messages back), so a killed backbone loses nothing accepted.

A request that can never succeed (another backbone or layer, a malformed tensor) is answered
with a non-retryable :class:`~schemas.feature.EncodeError` naming the field; one that comes
while the role stops, or whose answer could not be stored (the feature bucket not answering),
with a retryable one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import torch
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from pydantic import Field

from bus.auth import reply_allowed
from bus.codec import DecodeError, decode, encode
from bus.config import BackboneConfig
from bus.features import FeatureTransportError, pack_transient, take_blob
from bus.service import Runtime, ServiceStopping, serve
from schemas import subjects
from schemas.feature import (
    ENCODE_REQUEST_DECODER,
    ENCODE_REQUEST_ONLY_DECODER,
    BlobRef,
    EncodeError,
)
from vla.backbone import Backbone
from vla.feature import CompatKey, ModelInputs, VLAFeature
from vla.grouping import encode_each
from vla.wire import FeatureOrigin, FeatureRecordError, from_encode_request, to_record

log = logging.getLogger(__name__)


class BackboneServiceConfig(BackboneConfig):
    """Backbone role settings."""

    max_batch_samples: int = Field(
        1024, ge=1, description="Samples grouped into one round of forwards at most."
    )
    linger_ms: float = Field(
        0.0,
        ge=0,
        description="Wait this long for more requests before a round (0: group only what "
        "arrived while the previous round computed).",
    )


@dataclass
class _Pending:
    msg: Msg
    inputs: ModelInputs
    sample_ids: list[str]


class EncodeServer:
    """Groups the queued requests and answers each with its features."""

    def __init__(self, rt: Runtime, backbone: Backbone, config: BackboneServiceConfig) -> None:
        self.rt = rt
        self.backbone = backbone
        self.config = config
        self.bid = backbone.backbone_id
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.requests = 0
        self.samples = 0
        self.forwards = 0
        self.refused = 0
        self.busy_s = 0.0

    async def on_request(self, msg: Msg) -> None:
        if not reply_allowed(msg.reply):
            log.warning("encode request without a service inbox to answer at; dropped")
            return
        try:
            message = decode(ENCODE_REQUEST_DECODER, msg.data)
            if isinstance(message, BlobRef):
                stored = await take_blob(self.rt.js, message, self.bid)
                message = decode(ENCODE_REQUEST_ONLY_DECODER, stored)
            inputs, _ = from_encode_request(message, self.backbone.feature_layer)
            if message.backbone_id != self.bid:
                raise FeatureRecordError(
                    f"backbone_id: {message.backbone_id!r} asked of backbone {self.bid!r}"
                )
        except (DecodeError, FeatureRecordError, FeatureTransportError) as exc:
            self.refused += 1
            refusal = EncodeError(f"encode request: {exc}", retryable=False)
            await self.answer(msg, encode(refusal))
            return
        self.queue.put_nowait(_Pending(msg, inputs, list(message.sample_ids)))

    async def answer(self, msg: Msg, data: bytes) -> None:
        with contextlib.suppress(NatsError):
            await msg.respond(data)

    async def take_round(self) -> list[_Pending]:
        """The next requests to encode together: the first to come, then what is queued (and
        what comes within ``linger_ms``), up to ``max_batch_samples``."""
        first = await self.queue.get()
        batch, samples = [first], first.inputs.batch_size
        deadline = time.monotonic() + self.config.linger_ms / 1000
        while samples < self.config.max_batch_samples:
            try:
                if self.queue.empty() and time.monotonic() < deadline:
                    nxt = await asyncio.wait_for(self.queue.get(), deadline - time.monotonic())
                else:
                    nxt = self.queue.get_nowait()
            except (asyncio.QueueEmpty, TimeoutError):
                break
            batch.append(nxt)
            samples += nxt.inputs.batch_size
        return batch

    async def run_round(self, batch: list[_Pending]) -> None:
        # One forward per key and kind of inputs: requesters may send uint8 views or
        # normalised values (vla.wire.PIXEL_INPUTS), which do not concatenate.
        by_key: dict[tuple[CompatKey, tuple[str, ...]], list[_Pending]] = {}
        for pending in batch:
            kind = tuple(sorted(pending.inputs.tensors))
            by_key.setdefault((pending.inputs.key, kind), []).append(pending)
        groups = list(by_key.items())
        for index, ((key, _), group) in enumerate(groups):
            t0 = time.perf_counter()
            try:
                features = await self.rt.slow(encode_each, self.backbone, [p.inputs for p in group])
            except ServiceStopping:  # this group and those after it are answered: retry
                await self.refuse_stopping([p for _, later in groups[index:] for p in later])
                raise
            self.busy_s += time.perf_counter() - t0
            self.forwards += 1
            origin = FeatureOrigin(key, self.backbone.feature_layer)
            for pending, feature in zip(group, features, strict=True):
                await self.answer(pending.msg, await self.reply(pending, feature, origin))

    async def reply(
        self, pending: _Pending, feature: VLAFeature | Exception, origin: FeatureOrigin
    ) -> bytes:
        """The answer to one request: its record (by reference when it does not fit one
        message), or why not. A fault of the request's tensors is answered for good; any
        other (a device out of memory, the feature bucket not answering) may pass, so the
        requester retries, as it would a forward of its own."""
        if isinstance(feature, Exception):
            self.refused += 1
            retryable = not isinstance(feature, ValueError | TypeError | IndexError | KeyError)
            return encode(EncodeError(f"encode failed: {feature}", retryable=retryable))
        record = to_record(feature, origin, pending.sample_ids)
        try:
            data = await pack_transient(self.rt.js, record, self.bid, self.rt.nc.max_payload)
        except (NatsError, TimeoutError) as exc:  # it crashed the role, answering no one
            self.refused += 1
            message = f"the answer did not fit one message and the feature bucket refused it: {exc}"
            return encode(EncodeError(message, retryable=True))
        self.requests += 1
        self.samples += pending.inputs.batch_size
        return data

    async def refuse_stopping(self, pending: list[_Pending]) -> None:
        stopping = encode(EncodeError("the backbone is stopping; retry", retryable=True))
        for p in pending:
            await self.answer(p.msg, stopping)

    async def serve(self) -> None:
        while not self.rt.stop.is_set():
            take = asyncio.ensure_future(self.take_round())
            stop = asyncio.ensure_future(self.rt.stop.wait())
            await asyncio.wait({take, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not take.done():
                take.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await take
                break
            await self.run_round(take.result())

    async def refuse_queued(self) -> None:
        """Answer what is still queued as retryable (after the subscription ended)."""
        left = []
        while not self.queue.empty():
            left.append(self.queue.get_nowait())
        await self.refuse_stopping(left)

    def gauges(self) -> dict[str, float]:
        return {
            "encode_requests": float(self.requests),
            "encode_samples": float(self.samples),
            "encode_forwards": float(self.forwards),
            "encode_refused": float(self.refused),
            "encode_busy_s": self.busy_s,
            "encode_queued": float(self.queue.qsize()),
        }


async def run(config: BackboneServiceConfig) -> None:
    """Entry point: serve the backbone until SIGTERM/SIGINT."""

    async def body(rt: Runtime) -> None:
        torch.set_num_threads(config.torch_threads)
        backbone = await rt.slow(
            Backbone.load,
            config.backbone,
            dtype=config.dtype,
            device=config.device,
            backbone_id=config.backbone_id,
        )
        server = EncodeServer(rt, backbone, config)
        rt.gauges = server.gauges
        sub = await rt.nc.subscribe(
            subjects.features_encode(backbone.backbone_id),
            queue=subjects.features_queue(backbone.backbone_id),
            cb=server.on_request,
        )
        log.info("serving features of backbone %s", backbone.backbone_id)
        try:
            await server.serve()
        finally:
            with contextlib.suppress(NatsError, TimeoutError):
                await asyncio.wait_for(sub.unsubscribe(), 0.5)
            await server.refuse_queued()

    await serve("backbone", config, body)
