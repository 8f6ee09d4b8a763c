"""Reading KV and object-store state without consumers.

nats.py's ``KeyValue.keys()``, ``KeyValue.history()`` and ``ObjectStore.list()`` each create a
watcher (an ordered consumer, with tasks of its own) per call: polled in a loop, those pile up
on the server, and a call cancelled mid-way (a service stopping) never stops its watcher, so
its subscription and tasks outlive the caller. A KV bucket is a stream ``KV_<bucket>`` whose
subjects are ``$KV.<bucket>.<key>``, and an object store a stream ``OBJ_<bucket>`` whose
metadata subjects are ``$O.<bucket>.M.<name>``: the stream's per-subject state lists them in
one request, and each is read with a plain message get, which a cancellation leaves nothing of.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import BinaryIO, TypeVar

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, RawStreamMsg
from nats.js.errors import (
    BadObjectMetaError,
    BucketNotFoundError,
    DigestMismatchError,
    KeyDeletedError,
    KeyNotFoundError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

log = logging.getLogger(__name__)

#: Message gets in flight at once while listing an object store's metadata.
LIST_CONCURRENCY = 16

A = TypeVar("A")
T = TypeVar("T")


async def kv_keys(js: JetStreamContext, bucket: str, prefix: str = "") -> list[str]:
    """Keys of ``bucket`` (starting with ``prefix``) that hold a message: a value, or the
    marker of a deletion (use :func:`kv_values` for live values)."""
    prefix_subject = f"$KV.{bucket}."
    # A prefix of whole tokens ("tenant.") is filtered by the server.
    within = prefix if prefix.endswith(".") and "*" not in prefix and ">" not in prefix else ""
    try:
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix_subject}{within}>")
    except NotFoundError:
        return []
    keys = [s[len(prefix_subject) :] for s in (info.state.subjects or {})]
    return sorted(k for k in keys if k.startswith(prefix))


async def kv_values(js: JetStreamContext, bucket: str, prefix: str = "") -> dict[str, bytes]:
    """Live ``key → value`` of ``bucket`` under ``prefix`` (deleted and purged keys skipped)."""
    kv = await js.key_value(bucket)
    values: dict[str, bytes] = {}
    for key in await kv_keys(js, bucket, prefix):
        try:
            entry = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):  # deleted, purged or expired
            continue
        if entry.value:
            values[key] = entry.value
    return values


class ChunksMissingError(NatsError):
    """An object's metadata names chunks its stream (its leader) no longer holds: the object
    was deleted while it was read (reading it again finds it gone), or it is damaged."""


async def kv_history(kv: KeyValue, key: str) -> list[KeyValue.Entry]:
    """The entries the bucket still holds for ``key``, oldest first (deletions and purges
    included, as ``operation``); empty when it holds none."""
    # nats.py keeps the stream and subject prefix private; these are its KV layout.
    js, stream, subject = kv._js, kv._stream, f"{kv._pre}{key}"
    entries: list[KeyValue.Entry] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return entries
        entries.append(
            KeyValue.Entry(
                bucket=kv._name,
                key=key,
                value=msg.data,
                revision=msg.seq,
                delta=None,
                created=None,
                operation=_header(msg, "KV-Operation"),
            )
        )
        seq = (msg.seq or seq) + 1


@dataclass(frozen=True)
class ObjectListing:
    """An object store's metadata entries, as read: what :func:`object_listing` gives."""

    #: Every readable entry under the prefix, deleted objects' included.
    infos: list[ObjectInfo]
    #: Metadata subjects the stream held under the prefix when it was listed.
    subjects: int
    #: Entries whose metadata is not an object's (damaged): left out of ``infos``.
    unreadable: int


async def object_listing(store: ObjectStore, prefix: str = "") -> ObjectListing:
    """Every metadata entry of ``store`` whose name starts with ``prefix`` (empty for an
    empty or missing bucket). Only the entries under ``prefix`` are read (a name is in its
    metadata subject); one that is not an object's metadata is counted, not raised: it must
    not make the whole bucket unlistable (every reader of it failing, for good)."""
    js, stream = store._js, store._stream
    meta_prefix = f"$O.{store._name}.M."
    try:
        info = await js.stream_info(stream, subjects_filter=f"{meta_prefix}>")
    except NotFoundError:
        return ObjectListing([], 0, 0)
    wanted = [
        subject
        for subject in info.state.subjects or {}
        if _object_name(subject[len(meta_prefix) :]).startswith(prefix)
    ]

    async def read(subject: str) -> tuple[ObjectInfo | None, bool]:
        try:
            msg = await js.get_msg(stream, subject=subject)
        except NotFoundError:  # purged since the listing
            return None, False
        try:
            data = json.loads(msg.data or b"{}")
            if not isinstance(data, dict) or not isinstance(data.get("name"), str):
                raise ValueError("not an object's metadata")
            return ObjectInfo.from_response(data), False
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("object metadata %s is unreadable (%s); skipped", subject, exc)
            return None, True

    read_back = await _bounded(read, wanted, LIST_CONCURRENCY)
    infos = [i for i, _ in read_back if i is not None and (i.name or "").startswith(prefix)]
    return ObjectListing(infos, len(wanted), sum(bad for _, bad in read_back))


async def list_objects(store: ObjectStore, prefix: str = "") -> list[ObjectInfo]:
    """The live (not deleted) objects of ``store`` whose name starts with ``prefix``, in no
    particular order (see :func:`object_listing`)."""
    listing = await object_listing(store, prefix)
    return [i for i in listing.infos if not i.deleted]


async def read_object_into(store: ObjectStore, name: str, out: BinaryIO) -> ObjectInfo:
    """Write object ``name`` into ``out`` chunk by chunk, checked against its own digest;
    returns its info. Raises ``ObjectNotFoundError`` for a missing or deleted object,
    ``BadObjectMetaError`` for unreadable metadata, :class:`ChunksMissingError` for chunks
    gone, ``DigestMismatchError`` for chunks that do not match the metadata (also one more
    chunk than it names)."""
    info = await store.get_info(name)
    if info.deleted:
        raise ObjectNotFoundError
    if not info.nuid:
        raise BadObjectMetaError
    if not info.size:
        return info
    js, stream = store._js, store._stream
    subject = f"$O.{store._name}.C.{info.nuid}"
    sha = hashlib.sha256()
    received, seq = 0, 1
    while received < info.size:
        # A direct get carries the chunk's bytes as they are (no base64 in JSON); object
        # stores are created with direct gets allowed.
        msg = await _next_chunk(js, stream, subject, seq, confirm=True)
        if msg is None:
            raise ChunksMissingError(
                f"object {name}: its chunks end after {received} of {info.size} bytes "
                "(deleted while it was read?)"
            )
        chunk = msg.data or b""
        out.write(chunk)
        sha.update(chunk)
        received += len(chunk)
        seq = (msg.seq or seq) + 1
    trailing = await _next_chunk(js, stream, subject, seq)
    if (
        trailing is not None
        or received != info.size
        or sha.hexdigest() != object_sha256(info.digest)
    ):
        raise DigestMismatchError(description=f"{name}: chunks do not match its own digest")
    return info


class ObjectGoneError(Exception):
    """An object that is not there to read: its bucket, its metadata or its chunks gone."""


class ReferenceMismatchError(Exception):
    """An object whose bytes are not the size and digest its reference names."""


async def read_referenced(
    js: JetStreamContext, bucket: str, name: str, size: int, sha256: str
) -> bytes:
    """Object ``name`` of ``bucket``, which a message referenced with its ``size`` and hex
    ``sha256``. Raises :class:`ObjectGoneError` for an object that is not there and
    :class:`ReferenceMismatchError` for bytes that are not the referenced ones (what
    :func:`read_object_into` raises for chunks that do not match the object's own metadata
    passes through)."""
    buffer = io.BytesIO()
    try:
        store = await js.object_store(bucket)
        await read_object_into(store, name, buffer)
    except (BucketNotFoundError, ObjectNotFoundError, NotFoundError, ChunksMissingError) as exc:
        raise ObjectGoneError(f"object {bucket}/{name} is gone") from exc
    data = buffer.getvalue()
    if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
        raise ReferenceMismatchError(
            f"object {name}: {len(data)} bytes that do not match the reference's size {size} "
            "and digest"
        )
    return data


async def _next_chunk(
    js: JetStreamContext, stream: str, subject: str, seq: int, *, confirm: bool = False
) -> RawStreamMsg | None:
    try:
        return await js.get_msg(stream, seq=seq, subject=subject, next=True, direct=True)
    except NotFoundError:
        if not confirm:  # (past the last chunk: the digest check covers a short read)
            return None
    # A direct get may be answered by a replica that has not caught up yet (a cluster's R3
    # streams): "no more chunks" is the leader's word, so a read never calls an object
    # damaged that is only not replicated everywhere yet.
    try:
        return await js.get_msg(stream, seq=seq, subject=subject, next=True, direct=False)
    except NotFoundError:
        return None


def object_sha256(digest: str | None) -> str:
    """The hex SHA-256 of an object store entry (nats writes ``SHA-256=<base64url>``)."""
    if not digest or "=" not in digest:
        return ""
    try:
        return base64.urlsafe_b64decode(digest.split("=", 1)[1]).hex()
    except (ValueError, binascii.Error):
        return ""


def _object_name(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token).decode()
    except (ValueError, binascii.Error):  # not written by an object store: read it to see
        return ""


def _header(msg: RawStreamMsg, name: str) -> str | None:
    return (msg.headers or {}).get(name)


async def _bounded(call: Callable[[A], Awaitable[T]], args: list[A], limit: int) -> list[T]:
    """``call`` on each of ``args``, at most ``limit`` at once; results in order. One that
    fails cancels the rest (a task group), so none is left running unobserved."""
    slots = asyncio.Semaphore(limit)

    async def one(arg: A) -> T:
        async with slots:
            return await call(arg)

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(a)) for a in args]
    return [t.result() for t in tasks]


#: Object deletes in flight at once (:func:`delete_objects`).
PARALLEL_DELETES = 16


async def objects_under(store: ObjectStore, prefix: str) -> dict[str, ObjectInfo]:
    """``store``'s live objects under ``prefix`` by name (only theirs are read)."""
    return {info.name: info for info in await list_objects(store, prefix) if info.name}


async def delete_objects(store: ObjectStore, names: Iterable[str]) -> None:
    """Delete ``names`` from ``store``, :data:`PARALLEL_DELETES` at a time; one already gone
    is not an error, the first other error is raised."""
    slots = asyncio.Semaphore(PARALLEL_DELETES)

    async def one(name: str) -> None:
        async with slots:
            try:
                await store.delete(name)
            except (ObjectNotFoundError, NotFoundError):
                pass

    await asyncio.gather(*(one(name) for name in names))


@dataclass(frozen=True)
class Removed:
    """How many objects (and bytes in all) a removal deleted."""

    objects: int
    bytes: int


async def delete_under(store: ObjectStore, prefixes: list[str], *, first: str = "") -> Removed:
    """Delete ``store``'s objects under ``prefixes``, ``first`` (if there) before the rest."""
    objects: dict[str, ObjectInfo] = {}
    for prefix in prefixes:
        objects.update(await objects_under(store, prefix))
    if first in objects:
        await delete_objects(store, [first])
    await delete_objects(store, [name for name in objects if name != first])
    return Removed(len(objects), sum(int(info.size or 0) for info in objects.values()))
