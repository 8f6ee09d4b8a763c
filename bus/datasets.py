"""Datasets in tenants' namespaces: pushed through the master into the tenant's bucket, or
registered by the operator; resolved by (tenant, dataset id), never by a path a spec names.

A **pushed** dataset is one object per file under ``datasets/<id>/`` in the tenant's object
store bucket ``data-<tenant>`` (:func:`schemas.subjects.tenant_bucket`), and a manifest of
every file's size and SHA-256 written last (``datasets/<id>/MANIFEST``): a push that stops
half-way leaves no manifest, and pushing again uploads only the files whose object is
missing or differs. A tenant's identity has no JetStream (see :mod:`schemas.tenantctl`), so
the tenant side of a push (:func:`clients.push.push_dataset`) only sends requests: the
master plans the push, stores each file from its parts, checks every object and writes the
manifest and the dataset's :class:`~schemas.tenants.DatasetRecord` (``dataset-add``).
Whoever reads the dataset (a service) materialises it into a local cache, verifying each
digest again (:func:`materialise`). A **registered** dataset is a directory on the services'
disks that an operator put into a tenant's namespace (:func:`register_path`: it writes the
``datasets`` KV, which only service and operator identities may).

Checking that the files are a valid dataset is :mod:`vla.data`'s job (the master runs
``check_dataset`` on ``dataset-add`` and at submit); this module moves and verifies bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import shutil
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import msgspec
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import StorageType
from nats.js.errors import (
    BadObjectMetaError,
    BucketNotFoundError,
    DigestMismatchError,
    KeyNotFoundError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus.codec import DecodeError, decode, encode
from bus.datacache import MANIFEST, DatasetCache
from bus.kv import ChunksMissingError, kv_values, read_object_into
from schemas import subjects
from schemas.ids import InvalidIdError, validate_id
from schemas.tenantctl import (
    PART_BYTES,
)
from schemas.tenants import (
    DATASET_RECORD_DECODER,
    DatasetManifest,
    DatasetRecord,
    ManifestFile,
    dataset_key,
)

log = logging.getLogger(__name__)

#: Files larger than this are refused by :func:`scan` (the tenant's bucket has its own cap).
MAX_FILE_BYTES = 1 << 34


class DatasetStoreError(RuntimeError):
    """A dataset that cannot be pushed, found or verified. ``code`` is ``not_found``,
    ``invalid`` (the message names the file) or ``unavailable`` (``retryable``)."""

    def __init__(self, message: str, *, code: str = "invalid", retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable


MANIFEST_DECODER = msgspec.json.Decoder(DatasetManifest)


def prefix_of(dataset_id: str) -> str:
    """Object-name prefix of a pushed dataset's files: ``datasets/<id>/``."""
    return f"datasets/{validate_id(dataset_id, 'dataset id')}/"


def policy_object(job_id: str, version: int) -> str:
    """Object name of an exported policy in the tenant's bucket: ``policies/<job>/v<n>``."""
    return f"policies/{validate_id(job_id, 'job id')}/v{version}"


def not_in_namespace(tenant: str, dataset_id: str) -> DatasetStoreError:
    return DatasetStoreError(
        f"dataset {dataset_id!r} is not in tenant {tenant}'s namespace; push it with "
        "`joynexus data push` or ask the operator to register it",
        code="not_found",
    )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def scan(directory: Path) -> list[ManifestFile]:
    """Every regular file under ``directory`` with its size and digest, sorted by path.
    Symbolic links and files outside the directory are refused, naming the file."""
    root = Path(directory)
    if not root.is_dir():
        raise DatasetStoreError(f"{root}: not a directory")
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            raise DatasetStoreError(f"{rel}: symbolic links are not pushed")
        if not path.is_file():
            continue
        problem = path_problem(rel)
        if problem is not None:
            raise DatasetStoreError(f"{rel}: {problem}")
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise DatasetStoreError(f"{rel}: {size} bytes exceeds {MAX_FILE_BYTES}")
        files.append(ManifestFile(rel, size, sha256_file(path)))
    if not files:
        raise DatasetStoreError(f"{root}: no files to push")
    return files


async def tenant_store(js: JetStreamContext, tenant: str, *, create: bool) -> ObjectStore:
    """The tenant's bucket; ``create`` it when missing (open mode, or a service identity:
    under auth the operator creates it with the tenant's storage limit)."""
    bucket = subjects.tenant_bucket(tenant)
    try:
        return await js.object_store(bucket)
    except (BucketNotFoundError, NotFoundError) as exc:
        if not create:
            raise DatasetStoreError(
                f"tenant {tenant} has no bucket {bucket}: ask the operator to add the tenant",
                code="not_found",
            ) from exc
    try:
        return await js.create_object_store(bucket=bucket, storage=StorageType.FILE)
    except (NatsTimeoutError, TimeoutError) as exc:
        # Under auth a tenant may not create streams: the broker drops the request unanswered.
        raise DatasetStoreError(
            f"tenant {tenant} has no bucket {bucket} and this identity may not create it: "
            "ask the operator to add the tenant (`joynexus tenant add`)",
            code="not_found",
        ) from exc


def part_count(size: int) -> int:
    """How many parts of at most :data:`~schemas.tenantctl.PART_BYTES` a file of ``size``
    bytes travels in (an empty file is one empty part)."""
    return max(1, -(-size // PART_BYTES))


#: Longest file path in a pushed dataset, and longest path component (bytes, UTF-8): the
#: object's name travels base64-encoded in a subject, which the server caps at 4 KiB.
MAX_PATH_BYTES = 1024
MAX_NAME_BYTES = 255


def path_problem(path: str) -> str | None:
    """Why ``path`` cannot be a file of a pushed dataset (None when it can): it must be a
    relative, normalised POSIX path inside the dataset of at most :data:`MAX_PATH_BYTES`
    (components :data:`MAX_NAME_BYTES`) without control characters, and not its manifest's
    name."""
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return f"is longer than {MAX_PATH_BYTES} bytes"
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        return "contains a control character"
    if any(len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for part in path.split("/")):
        return f"has a component longer than {MAX_NAME_BYTES} bytes"
    rel = PurePosixPath(path)
    if not path or rel.is_absolute() or ".." in rel.parts:
        return "leaves the dataset (absolute, empty or with '..')"
    if rel.as_posix() != path or "." in path.split("/"):
        return "is not a normalised relative path"
    if path == MANIFEST:
        return f"is the dataset's manifest name ({MANIFEST}), which a file may not have"
    return None


def encode_manifest(manifest: DatasetManifest) -> bytes:
    return msgspec.json.encode(manifest)


async def read_manifest(
    js: JetStreamContext, bucket: str, dataset_id: str
) -> tuple[DatasetManifest, str]:
    """The pushed dataset's manifest and its SHA-256; ``not_found`` when the push never
    finished (or never started)."""
    name = prefix_of(dataset_id) + MANIFEST
    buffer = io.BytesIO()
    try:
        await download(js, bucket, name, buffer)
        data = buffer.getvalue()
    except (ObjectNotFoundError, NotFoundError) as exc:
        raise DatasetStoreError(
            f"dataset {dataset_id!r} has no manifest in the tenant's bucket: the push did not "
            "finish; push it again with `joynexus data push`",
            code="not_found",
        ) from exc
    try:
        manifest = MANIFEST_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DatasetStoreError(f"{name}: malformed manifest: {exc}") from exc
    if manifest.dataset != dataset_id:
        raise DatasetStoreError(f"{name}: manifest names dataset {manifest.dataset!r}")
    for entry in manifest.files:
        problem = path_problem(entry.path)
        if problem is not None:
            raise DatasetStoreError(f"{name}: file path {entry.path!r} {problem}")
    return manifest, hashlib.sha256(data).hexdigest()


async def download(
    js: JetStreamContext, bucket: str, name: str, out: BinaryIO, *, timeout: float = 30.0
) -> int:
    """Write object ``name`` of ``bucket`` into ``out``, checked against the object's own
    digest; return its size (services: a tenant has no JetStream). Streams the object
    (:func:`bus.kv.read_object_into`) instead of holding it in memory. Raises
    ObjectNotFoundError for a missing object and :class:`DatasetStoreError` for a torn one,
    or one not read within ``timeout`` (retryable)."""
    store = await js.object_store(bucket)
    try:
        info = await asyncio.wait_for(read_object_into(store, name, out), timeout)
    except (TimeoutError, ChunksMissingError) as exc:
        raise DatasetStoreError(
            f"{name}: not read within {timeout:g}s" if isinstance(exc, TimeoutError) else str(exc),
            code="unavailable",
            retryable=True,
        ) from exc
    except (DigestMismatchError, BadObjectMetaError) as exc:
        raise DatasetStoreError(f"{name}: object does not match its own digest") from exc
    return int(info.size or 0)


async def _download(
    js: JetStreamContext, bucket: str, name: str, entry: ManifestFile, target: Path
) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with target.open("wb") as f:
            await download(js, bucket, name, f)
    except (ObjectNotFoundError, NotFoundError) as exc:
        raise DatasetStoreError(f"{entry.path}: listed in the manifest but not pushed") from exc
    except DatasetStoreError as exc:
        raise DatasetStoreError(
            f"{entry.path}: {exc}", code=exc.code, retryable=exc.retryable
        ) from exc
    size, got = await asyncio.to_thread(lambda: (target.stat().st_size, sha256_file(target)))
    if size != entry.size or got != entry.sha256:
        raise DatasetStoreError(
            f"{entry.path}: sha256 {got[:16]}… ({size} bytes) does not match the manifest's "
            f"{entry.sha256[:16]}… ({entry.size} bytes); push the dataset again"
        )


async def materialise(
    js: JetStreamContext,
    tenant: str,
    dataset_id: str,
    cache: DatasetCache,
    *,
    expected_digest: str = "",
) -> tuple[Path, DatasetManifest, str]:
    """Download a pushed dataset into ``cache`` (once per manifest digest), verifying every
    file; return its directory, manifest and the manifest's digest. With
    ``expected_digest`` (a DatasetRecord's), a manifest pushed since is refused. A download
    first makes room in the cache (:meth:`DatasetCache.evict`)."""
    await tenant_store(js, tenant, create=False)  # a clear error when it is missing
    manifest, digest = await read_manifest(js, subjects.tenant_bucket(tenant), dataset_id)
    if expected_digest and digest != expected_digest:
        raise DatasetStoreError(
            f"dataset {dataset_id!r} was pushed again since it was added (manifest "
            f"{digest[:16]}…, recorded {expected_digest[:16]}…): run dataset-add again"
        )
    target = cache.entry(tenant, dataset_id, digest)
    sizes = {entry.path: entry.size for entry in manifest.files}
    if await asyncio.to_thread(cache.use, target, sizes):
        return target, manifest, digest
    try:
        await asyncio.to_thread(cache.evict, room=manifest.total_bytes)
    except OSError as exc:  # the download may still fit: it says so if not
        log.warning("dataset cache %s: eviction failed: %s", cache.root, exc)
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    try:
        prefix = prefix_of(dataset_id)
        for entry in manifest.files:
            bucket = subjects.tenant_bucket(tenant)
            await _download(js, bucket, prefix + entry.path, entry, tmp / entry.path)
        (tmp / MANIFEST).write_bytes(encode_manifest(manifest))
        await asyncio.to_thread(cache.replace, target, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        await asyncio.to_thread(cache.prune_versions, target)
    except OSError as exc:
        log.warning("dataset cache %s: pruning older copies failed: %s", cache.root, exc)
    return target, manifest, digest


# -- the ``datasets`` KV ----------------------------------------------------------------------


async def datasets_kv(js: JetStreamContext) -> KeyValue:
    try:
        return await js.key_value(subjects.KV_DATASETS)
    except (BucketNotFoundError, NotFoundError) as exc:
        raise DatasetStoreError(
            f"the {subjects.KV_DATASETS} KV bucket is not declared yet",
            code="unavailable",
            retryable=True,
        ) from exc


async def get_dataset(js: JetStreamContext, tenant: str, dataset_id: str) -> DatasetRecord | None:
    """The record of ``dataset_id`` in ``tenant``'s namespace, or None."""
    kv = await datasets_kv(js)
    try:
        entry = await kv.get(dataset_key(tenant, dataset_id))
    except KeyNotFoundError:
        return None
    if not entry.value:
        return None
    return decode(DATASET_RECORD_DECODER, entry.value)


async def put_dataset(js: JetStreamContext, record: DatasetRecord) -> None:
    """Write (or replace) a dataset record; service and operator identities only."""
    kv = await datasets_kv(js)
    await kv.put(dataset_key(record.tenant, record.dataset), encode(record))


async def delete_dataset(js: JetStreamContext, tenant: str, dataset_id: str) -> bool:
    """Delete a dataset's record and its history (service identities only); whether there
    was one."""
    if await get_dataset(js, tenant, dataset_id) is None:
        return False
    kv = await datasets_kv(js)
    await kv.purge(dataset_key(tenant, dataset_id))
    return True


async def list_datasets(js: JetStreamContext, tenant: str) -> list[DatasetRecord]:
    """The tenant's datasets, by id."""
    values = await kv_values(js, subjects.KV_DATASETS, f"{validate_id(tenant, 'tenant')}.")
    records = []
    for value in values.values():
        try:
            records.append(decode(DATASET_RECORD_DECODER, value))
        except DecodeError:
            continue
    return sorted(records, key=lambda r: r.dataset)


async def register_path(
    js: JetStreamContext, tenant: str, dataset_id: str, path: str | Path
) -> DatasetRecord:
    """Put the directory ``path`` on the services' disks into ``tenant``'s namespace as
    ``dataset_id`` (operator or service identity: it writes the ``datasets`` KV). The
    master checks it as a dataset when a job names it."""
    try:
        validate_id(tenant, "tenant")
        validate_id(dataset_id, "dataset id")
    except InvalidIdError as exc:
        raise DatasetStoreError(str(exc)) from exc
    directory = await asyncio.to_thread(Path(path).resolve)
    if not await asyncio.to_thread(directory.is_dir):
        raise DatasetStoreError(f"{path}: not a directory", code="not_found")
    record = DatasetRecord(
        tenant=tenant,
        dataset=dataset_id,
        source="registered",
        created_at=time.time(),
        path=str(directory),
    )
    await put_dataset(js, record)
    return record


async def resolve(
    js: JetStreamContext, tenant: str, dataset_id: str, cache: DatasetCache
) -> tuple[Path, DatasetRecord]:
    """The local directory of ``dataset_id`` in ``tenant``'s namespace (a registered path, or
    a pushed dataset materialised into ``cache``) and its record."""
    try:
        validate_id(dataset_id, "dataset id")
    except InvalidIdError as exc:
        raise not_in_namespace(tenant, dataset_id) from exc
    record = await get_dataset(js, tenant, dataset_id)
    if record is None or record.tenant != tenant:
        raise not_in_namespace(tenant, dataset_id)
    if record.source == "registered":
        return Path(record.path), record
    directory, _, _ = await materialise(
        js, tenant, dataset_id, cache, expected_digest=record.digest
    )
    return directory, record
