"""The ``placement`` KV, typed: announce what this instance serves; list what is served.

A trainer or inferencer wraps its serving loop in ``async with placed(rt, backbone)``; the
master, the CLI and the SDK read :func:`placements` (every record) or
:func:`live_placements` (only those whose instance still heartbeats: a SIGKILLed instance
cannot delete its key).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from bus.codec import DecodeError, decode, encode
from bus.kv import kv_values
from schemas import subjects
from schemas.health import HEARTBEAT_DECODER
from schemas.placement import PLACEMENT_DECODER, PlacementRecord, placement_key

if TYPE_CHECKING:
    from bus.service import Runtime


class ServedBackbone(Protocol):
    """What a loaded backbone (:class:`vla.backbone.Backbone`) tells about itself."""

    backbone_id: str
    model_type: str
    num_params: int
    image_size: int
    image_token_count: int
    hidden_size: int
    model: Any


def _max_tokens(backbone: ServedBackbone) -> int:
    """The decoder's position budget, where its config states one (0 otherwise)."""
    try:
        text_config = backbone.model.config.get_text_config()
    except AttributeError:
        return 0
    return int(getattr(text_config, "max_position_embeddings", 0) or 0)


def record_of(backbone: ServedBackbone, role: str, instance: str) -> PlacementRecord:
    """The placement record of ``instance`` of ``role`` serving ``backbone``."""
    return PlacementRecord(
        backbone=backbone.backbone_id,
        role=role,
        instance=instance,
        model_type=backbone.model_type,
        num_params=int(backbone.num_params),
        image_size=int(backbone.image_size),
        image_tokens=int(backbone.image_token_count),
        max_tokens=_max_tokens(backbone),
        hidden_size=int(backbone.hidden_size),
        dtype=str(getattr(backbone, "dtype", "")).removeprefix("torch."),
        device=str(getattr(backbone, "device", "")),
        at=time.time(),
    )


@contextlib.asynccontextmanager
async def placed(rt: Runtime, backbone: ServedBackbone) -> AsyncIterator[PlacementRecord]:
    """Announce in the ``placement`` KV that this instance serves ``backbone`` for as long as
    the block runs (key ``<role>.<backbone>.<instance>``)."""
    kv = await rt.js.key_value(subjects.KV_PLACEMENT)
    record = record_of(backbone, rt.role, rt.instance)
    await kv.put(placement_key(record), encode(record))
    try:
        yield record
    finally:
        with contextlib.suppress(NatsError, TimeoutError):
            await kv.delete(placement_key(record))


async def placements(js: JetStreamContext) -> list[PlacementRecord]:
    """Every placement record, live or left behind by a killed instance; a value that does
    not decode (an older writer's) is skipped."""
    records = []
    for value in (await kv_values(js, subjects.KV_PLACEMENT)).values():
        with contextlib.suppress(DecodeError):
            records.append(decode(PLACEMENT_DECODER, value))
    return sorted(records, key=lambda r: (r.backbone, r.role, r.instance))


async def live_placements(js: JetStreamContext) -> list[PlacementRecord]:
    """The placement records whose instance has a fresh heartbeat: one the ``heartbeats``
    bucket still holds, since its TTL expires a heartbeat by the server's clock (the time
    the sender wrote in it is another host's clock, skewed by any amount)."""
    alive = set()
    for key, value in (await kv_values(js, subjects.KV_HEARTBEATS)).items():
        with contextlib.suppress(DecodeError):
            decode(HEARTBEAT_DECODER, value)
            alive.add(key)
    return [r for r in await placements(js) if f"{r.role}.{r.instance}" in alive]
