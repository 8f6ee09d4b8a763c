"""Checkpoints in the ``checkpoints`` object store: content-hashed names, retention pruning.

Object names are ``<tenant>/<job>/v<version>-<sha256[:16]>``; the full digest is in the
``policies`` record and verified on load, so a torn or foreign object is never restored.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
from collections.abc import Collection

from nats.js.errors import (
    BadObjectMetaError,
    DigestMismatchError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.object_store import ObjectStore

from bus.kv import ChunksMissingError, list_objects, read_object_into

#: How long reading one checkpoint may take.
READ_TIMEOUT_S = 60.0


class CheckpointError(RuntimeError):
    """A checkpoint object is missing or does not match its recorded digest."""


def object_name(tenant: str, job_id: str, version: int, sha256: str) -> str:
    return f"{tenant}/{job_id}/v{version:06d}-{sha256[:16]}"


def version_of(name: str) -> int:
    """The policy version an :func:`object_name` holds (0 if ``name`` is not one)."""
    tail = name.rsplit("/", 1)[-1]
    try:
        return int(tail[1:].split("-", 1)[0]) if tail.startswith("v") else 0
    except ValueError:
        return 0


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _store_digest(data: bytes) -> str:
    """``data``'s digest as the object store writes it in an object's metadata."""
    return "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()


async def put_checkpoint(store: ObjectStore, name: str, data: bytes) -> None:
    """Store ``data`` as ``name``, unless the store holds exactly these bytes under it
    already (a retried commit whose first write landed unseen): rewriting them would move
    the object to new chunks and purge the old ones under a reader loading it."""
    try:
        info = await store.get_info(name)
    except (ObjectNotFoundError, NotFoundError, BadObjectMetaError):
        info = None
    if info is not None and info.size == len(data) and info.digest == _store_digest(data):
        return
    await store.put(name, data)


async def read_object(store: ObjectStore, name: str) -> bytes | None:
    """An object's bytes (the object store checks its own digest); None if it is gone.

    :class:`CheckpointError` when it is damaged: its chunks missing (by the stream leader's
    word) on a second read too (the first may have raced a deletion, after which the object
    reads as gone), or not matching its metadata. Retrying cannot mend either, so the
    caller answers instead."""
    try:
        return await _read_whole(store, name)
    except ChunksMissingError:
        pass
    try:
        return await _read_whole(store, name)
    except ChunksMissingError as exc:
        raise CheckpointError(f"checkpoint {name} is damaged: {exc}") from exc


async def _read_whole(store: ObjectStore, name: str) -> bytes | None:
    buffer = io.BytesIO()
    try:
        await read_object_into(store, name, buffer)
    except (ObjectNotFoundError, NotFoundError):
        return None
    except (DigestMismatchError, BadObjectMetaError) as exc:
        raise CheckpointError(f"checkpoint {name} is corrupt: {exc}") from exc
    return buffer.getvalue()


async def get_checkpoint(
    store: ObjectStore, name: str, sha256: str, timeout_s: float = READ_TIMEOUT_S
) -> bytes:
    """Read a checkpoint (streamed into one buffer, avoiding nats.py's quadratic
    concatenation) and verify its digest. :class:`CheckpointError` for a missing, damaged or
    corrupt one; ``TimeoutError`` after ``timeout_s``."""
    try:
        # Each chunk is one request with its own deadline; this bounds the whole read (a
        # large checkpoint on a slow server). A cancelled read leaves nothing behind.
        data = await asyncio.wait_for(read_object(store, name), timeout_s)
    except TimeoutError as exc:
        raise TimeoutError(f"checkpoint {name} not read within {timeout_s:g}s") from exc
    if data is None:
        raise CheckpointError(f"checkpoint {name} not found")
    if digest(data) != sha256:
        raise CheckpointError(f"checkpoint {name} does not match its recorded sha256")
    return data


async def prune(
    store: ObjectStore,
    tenant: str,
    job_id: str,
    keep_from_version: int,
    keep: Collection[str] = (),
) -> int:
    """Delete this job's checkpoint objects older than ``keep_from_version`` (except those
    named in ``keep``: a session's saved states); return how many."""
    prefix = f"{tenant}/{job_id}/v"
    removed = 0
    for info in await list_objects(store, prefix):
        name = info.name or ""
        if name in keep:
            continue
        try:
            version = int(name[len(prefix) :].split("-", 1)[0])
        except ValueError:
            continue
        if version < keep_from_version:
            await store.delete(name)
            removed += 1
    return removed
