"""Feature records across the bus: inline when they fit one message, by reference otherwise.

:func:`pack` turns a :class:`~schemas.feature.FeatureRecord` into the bytes of a message: the
record itself when its encoding leaves room under the server's ``max_payload`` (headers and
the other fields of the message it rides in take :data:`HEADROOM`), else a
:class:`~schemas.feature.FeatureRef` to a copy stored in the backbone's feature bucket
(:func:`schemas.subjects.feature_bucket`) under its content digest: storing the same record
twice stores one object. :func:`unpack` is the inverse, fetching and checking the digest of a
referenced record.

:func:`pack_transient` / :func:`take_blob` do the same for a message read once (an encode
request, its answer): stored under a fresh name as a :class:`~schemas.feature.BlobRef`, and
deleted by its reader, so the bucket holds only messages in flight.
"""

from __future__ import annotations

import contextlib
import hashlib
import uuid

import msgspec
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from bus.codec import DecodeError, decode, encode
from bus.kv import ObjectGoneError, ReferenceMismatchError, read_referenced
from schemas import subjects
from schemas.feature import (
    FEATURE_DECODER,
    FEATURE_RECORD_DECODER,
    BlobRef,
    FeatureRecord,
    FeatureRef,
)

#: Bytes of a message left for headers and the fields around a record.
HEADROOM = 16 * 1024


class FeatureTransportError(RuntimeError):
    """A referenced record that is missing, or whose bytes are not the ones referenced."""


async def feature_store(
    js: JetStreamContext, backbone: str, max_bytes: int | None = None
) -> ObjectStore:
    """The backbone's feature bucket, created on first use (``max_bytes``: its budget)."""
    bucket = subjects.feature_bucket(backbone)
    try:
        return await js.object_store(bucket)
    except (BucketNotFoundError, NotFoundError):
        config = ObjectStoreConfig(bucket=bucket, max_bytes=max_bytes or -1)
        return await js.create_object_store(bucket, config=config)


async def pack(
    js: JetStreamContext, record: FeatureRecord, max_payload: int
) -> tuple[bytes, FeatureRef | None]:
    """The message bytes for ``record``, and the reference when it went by reference."""
    data = encode(record)
    if len(data) + HEADROOM <= max_payload:
        return data, None
    sha = hashlib.sha256(data).hexdigest()
    store = await feature_store(js, record.backbone_id)
    name = f"{record.feature_layer}/{sha}"
    try:
        await store.get_info(name)
    except (ObjectNotFoundError, NotFoundError):
        await store.put(name, data)
    ref = FeatureRef(
        backbone_id=record.backbone_id,
        feature_layer=record.feature_layer,
        image_size=record.image_size,
        num_views=record.num_views,
        token_budget=record.token_budget,
        sample_ids=list(record.sample_ids),
        bucket=subjects.feature_bucket(record.backbone_id),
        object_name=name,
        size=len(data),
        sha256=sha,
    )
    return encode(ref), ref


async def unpack(js: JetStreamContext, data: bytes) -> FeatureRecord:
    """The record a message carries, fetched from its bucket if it went by reference.
    Raises :class:`bus.codec.DecodeError` for bytes that are no feature message and
    :class:`FeatureTransportError` for a reference that cannot be honoured."""
    message = decode(FEATURE_DECODER, data)
    if isinstance(message, FeatureRecord):
        return message
    if message.bucket != subjects.feature_bucket(message.backbone_id):
        raise FeatureTransportError(
            f"bucket: {message.bucket!r} is not backbone {message.backbone_id!r}'s feature bucket"
        )
    try:
        stored = await read_referenced(
            js, message.bucket, message.object_name, message.size, message.sha256
        )
    except (ObjectGoneError, ReferenceMismatchError) as exc:
        raise FeatureTransportError(f"feature {exc}") from exc
    try:
        record = decode(FEATURE_RECORD_DECODER, stored)
    except DecodeError as exc:
        raise FeatureTransportError(f"feature object {message.object_name}: {exc}") from exc
    if record.sample_ids != message.sample_ids or record.backbone_id != message.backbone_id:
        raise FeatureTransportError(
            f"feature object {message.object_name} holds other samples than its reference"
        )
    return record


async def pack_transient(
    js: JetStreamContext, message: msgspec.Struct, backbone: str, max_payload: int
) -> bytes:
    """``message``'s bytes, or those of a :class:`BlobRef` to them in ``backbone``'s feature
    bucket when they do not fit one message (the reader deletes the object)."""
    data = encode(message)
    if len(data) + HEADROOM <= max_payload:
        return data
    store = await feature_store(js, backbone)
    name = f"transient/{uuid.uuid4().hex}"
    await store.put(name, data)
    bucket = subjects.feature_bucket(backbone)
    return encode(BlobRef(bucket, name, len(data), hashlib.sha256(data).hexdigest()))


async def take_blob(js: JetStreamContext, ref: BlobRef, backbone: str) -> bytes:
    """The bytes ``ref`` names (checked against its size and digest), deleting the object.
    Raises :class:`FeatureTransportError` for a reference outside ``backbone``'s bucket or one
    that cannot be honoured."""
    if ref.bucket != subjects.feature_bucket(backbone) or not ref.object_name.startswith(
        "transient/"
    ):
        raise FeatureTransportError(
            f"bucket: {ref.bucket}/{ref.object_name} is not a transient object of backbone "
            f"{backbone!r}'s feature bucket"
        )
    try:
        data = await read_referenced(js, ref.bucket, ref.object_name, ref.size, ref.sha256)
    except ObjectGoneError as exc:
        raise FeatureTransportError(str(exc)) from exc
    except ReferenceMismatchError as exc:
        await _delete(js, ref)  # read once: nobody reads it again
        raise FeatureTransportError(str(exc)) from exc
    await _delete(js, ref)
    return data


async def _delete(js: JetStreamContext, ref: BlobRef) -> None:
    with contextlib.suppress(NatsError, ObjectNotFoundError, NotFoundError):
        store = await js.object_store(ref.bucket)
        await store.delete(ref.object_name)
