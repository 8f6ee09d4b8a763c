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
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus.kv import ChunksMissingError, list_objects, read_object_into
from bus.records import policy_history

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


#: The object store's digest prefix (nats.py writes ``SHA-256=<base64url>``).
_STORE_DIGEST_PREFIX = "SHA-256="


def _store_digest(data: bytes) -> str:
    """``data``'s digest as the object store writes it in an object's metadata."""
    return _STORE_DIGEST_PREFIX + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()


def _hex_digest(object_digest: str | None) -> str | None:
    """The object store's ``SHA-256=<base64url>`` digest as hex (None if absent/other)."""
    if not object_digest or not object_digest.upper().startswith(_STORE_DIGEST_PREFIX):
        return None
    try:
        raw = base64.urlsafe_b64decode(object_digest[len(_STORE_DIGEST_PREFIX) :])
    except ValueError:
        return None
    return raw.hex()


async def committed_object(
    policies: KeyValue, store: ObjectStore, tenant: str, job_id: str, version: int
) -> tuple[str, str]:
    """Object name and sha256 of a job's checkpoint ``version``: the one its commit
    recorded, while the ``policies`` history holds it; else the one object stored for it.
    :class:`CheckpointError` when none is stored, when several are (a commit that failed
    after writing its object left one behind: none is known to be the one committed), or
    when the one found does not carry the digest its name begins with. Bus errors are
    raised as they are."""
    for record in reversed(await policy_history(policies, tenant, job_id)):
        if record.version == version:
            return record.object_name, record.sha256
    prefix = f"{tenant}/{job_id}/v{version:06d}-"
    found = await list_objects(store, prefix)
    if len(found) > 1:
        names = ", ".join(sorted(info.name or "" for info in found))
        raise CheckpointError(
            f"policy version {version} of {tenant}/{job_id} is stored as several objects "
            f"({names}) and its commit record is gone: none is known to be the one committed"
        )
    if not found:
        raise CheckpointError(
            f"policy version {version} of {tenant}/{job_id} is no longer stored "
            "(the trainer keeps only its most recent versions)"
        )
    name = found[0].name or ""
    sha256 = _hex_digest(found[0].digest)
    # The name carries the first 16 hex digits of the content hash: both must agree.
    if sha256 is None or not sha256.startswith(name[len(prefix) :]):
        raise CheckpointError(f"checkpoint {name} has no matching content digest")
    return name, sha256


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
