"""Bytes a tenant moves, moved for it by the master: dataset pushes and policy downloads.

A tenant's identity has no JetStream (:mod:`schemas.tenantctl` says why), so it can neither
put objects into its bucket ``data-<tenant>`` nor read them back. It sends its files in
parts instead, by core request-reply, and the master (a service identity) does the
object-store work in the same layout a direct upload had, so :func:`bus.datasets.materialise`
and everything that reads datasets are unchanged:

* ``dataset-plan``: drop the dataset's old manifest (a half-replaced dataset is never
  complete) and the parts an earlier, interrupted push left behind, and answer which files
  are missing or differ (``datasets/<id>/<path>`` compared by size and SHA-256).
* ``dataset-part``: each part of a file is stored as its own object,
  ``uploads/<id>/<sha256>/<index>`` in the tenant's bucket, so a master restart loses none
  and another master of the queue group can take the next part. The last part makes the
  master join the parts through a temporary file (never the whole file in memory), check
  the file's size and digest, store it as ``datasets/<id>/<path>`` and delete the parts.
* ``dataset-add`` with files (:meth:`Transfer.write_manifest`): every file must be stored
  with its digest before the manifest is written.
* ``export-read``: a piece of an exported policy (``policies/<job>/v<n>``), served from a
  small cache so that reading an export part by part downloads it once.

The tenant's storage limit is its bucket's ``max_bytes``: a put past it is refused naming the
file and the limit. Which tenant asks is the request subject's token, already checked by
:meth:`services.master.queries.Queries.answer`; errors the bus causes become ``unavailable``
there too.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import re
import tempfile
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from typing import IO, BinaryIO

from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectMeta, ObjectMetaOptions
from nats.js.errors import APIError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from bus.datasets import (
    MANIFEST,
    MAX_FILE_BYTES,
    DatasetStoreError,
    download,
    encode_manifest,
    part_count,
    path_problem,
    prefix_of,
    read_manifest,
    tenant_store,
)
from bus.kv import delete_objects, delete_under, object_sha256, objects_under
from schemas import subjects
from schemas.ids import validate_id
from schemas.tenantctl import (
    PART_BYTES,
    AddDataset,
    CtlError,
    DatasetPlan,
    ExportBytes,
    PartStored,
    PlanDataset,
    PutDatasetPart,
    ReadExport,
    TenantReply,
)
from schemas.tenants import DatasetManifest, ManifestFile
from services.master.limits import TenantGate

log = logging.getLogger(__name__)

#: Object-store requests in flight at once for one push (deleting parts, for example).
PARALLEL = 16
#: Exports kept for reading in parts: at most this many objects and (but for the newest,
#: which is always kept) this many bytes in all.
CACHED_EXPORTS = 4
CACHED_EXPORT_BYTES = 2 << 30
#: An export read within this long is kept past CACHED_EXPORTS (only the byte cap evicts it).
EXPORT_IDLE_S = 30.0

#: JetStream's error code for a write the stream refused to store, which for a tenant's
#: bucket means its limits ("maximum bytes exceeded": the tenant's storage limit).
STORE_REFUSED = 10077

_SHA256 = re.compile(r"[0-9a-f]{64}")
_EXPORT_NAME = re.compile(r"policies/([^/]+)/v([0-9]+)")


def uploads_prefix(dataset: str) -> str:
    """Where the parts of a dataset's files wait for their last part: ``uploads/<id>/``."""
    return f"uploads/{validate_id(dataset, 'dataset id')}/"


def part_object(dataset: str, sha256: str, index: int) -> str:
    """The object holding part ``index`` of the file with digest ``sha256``."""
    return f"{uploads_prefix(dataset)}{sha256}/{index}"


def checked_file(entry: ManifestFile) -> ManifestFile:
    """``entry`` if it can be a file of a pushed dataset; DatasetStoreError naming it if not."""
    problem = path_problem(entry.path)
    if problem is not None:
        raise DatasetStoreError(f"file path {entry.path!r} {problem}")
    if not 0 <= entry.size <= MAX_FILE_BYTES:
        raise DatasetStoreError(f"{entry.path}: size {entry.size} is not in 0..{MAX_FILE_BYTES}")
    if not _SHA256.fullmatch(entry.sha256):
        raise DatasetStoreError(f"{entry.path}: sha256 {entry.sha256!r} is not 64 hex digits")
    return entry


def checked_files(files: Iterable[ManifestFile]) -> list[ManifestFile]:
    """Every file checked (:func:`checked_file`); a path listed twice, or one that another
    file's path makes a directory (``a`` beside ``a/b``), is refused."""
    seen: set[str] = set()
    out = []
    for entry in files:
        checked_file(entry)
        if entry.path in seen:
            raise DatasetStoreError(f"{entry.path}: listed twice")
        seen.add(entry.path)
        out.append(entry)
    directories = {"/".join(p.split("/")[:i]) for p in seen for i in range(1, p.count("/") + 1)}
    for clash in sorted(seen & directories):
        raise DatasetStoreError(f"{clash}: is a file and also a directory of other files")
    if not out:
        raise DatasetStoreError("files: a dataset has at least one file")
    return out


def _same(info: ObjectInfo | None, entry: ManifestFile) -> bool:
    return (
        info is not None
        and not info.deleted
        and info.size == entry.size
        and object_sha256(info.digest) == entry.sha256
    )


class _Cached:
    """One exported object, in an unlinked temporary file: checkpoints reach hundreds of
    megabytes, so the cache holds them on disk (the page cache keeps recent ones in memory)
    and nothing is left behind when the master stops. Reads are ``os.pread`` on the event
    loop (a part is 256 KiB, from the page cache), so no read is in flight when an entry is
    evicted and its descriptor closed."""

    def __init__(self) -> None:
        fd, path = tempfile.mkstemp(prefix="joynexus-export-")
        os.unlink(path)
        self.fd = fd
        self.size = 0
        self.last_used = time.monotonic()
        # Closes the descriptor on eviction, or when the cache itself goes away.
        self.close = weakref.finalize(self, os.close, fd)

    def writer(self) -> BinaryIO:
        """A file object over the descriptor that leaves it open when closed."""
        return os.fdopen(self.fd, "wb", closefd=False)

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)


class Transfer:
    """The master's object-store work for tenants' pushes and policy downloads."""

    def __init__(self, js: JetStreamContext, gate: TenantGate) -> None:
        self.js = js
        self.gate = gate
        # Keyed by (bucket, object name, nuid): a put under the same name gets a new nuid.
        self._exports: OrderedDict[tuple[str, str, str], _Cached] = OrderedDict()
        self._loading: dict[tuple[str, str, str], asyncio.Task[_Cached]] = {}

    async def store(self, tenant: str) -> ObjectStore:
        """The tenant's bucket. A registered tenant's is made by the operator with its
        storage limit (``max_bytes``), so the master never creates one without it; in open
        mode (no tenant registered) it is created here."""
        registered = await self.gate.record(tenant) is not None
        return await tenant_store(self.js, tenant, create=not registered)

    # -- dataset pushes ---------------------------------------------------------------------

    async def plan(self, request: PlanDataset) -> TenantReply:
        """Start (or resume) a push: drop the old manifest and stale parts, answer the files
        whose object is missing or has another digest or size."""
        tenant, dataset = request.tenant, validate_id(request.dataset, "dataset id")
        files = checked_files(request.files)
        store = await self.store(tenant)
        prefix = prefix_of(dataset)
        objects = await objects_under(store, prefix)
        needed = [f.path for f in files if not _same(objects.get(prefix + f.path), f)]
        # A push resumes file by file, so parts of an interrupted one are never used again;
        # they would only hold the tenant's storage.
        await delete_under(store, [uploads_prefix(dataset)])
        if not needed and await self._manifest_lists(tenant, dataset, files):
            # The same files pushed again: the dataset stays complete under its manifest. A
            # new manifest would be a new digest, and one more full copy of the dataset on
            # every machine that materialises it.
            log.info("push of %s/%s: unchanged", tenant, dataset)
            return DatasetPlan([])
        # From here on the dataset is incomplete until dataset-add.
        await delete_objects(store, [prefix + MANIFEST])
        log.info("push of %s/%s: %d of %d files needed", tenant, dataset, len(needed), len(files))
        return DatasetPlan(needed)

    async def _manifest_lists(self, tenant: str, dataset: str, files: list[ManifestFile]) -> bool:
        """Whether the dataset's manifest lists exactly ``files`` (False: none, or another)."""
        try:
            manifest, _ = await read_manifest(self.js, subjects.tenant_bucket(tenant), dataset)
        except DatasetStoreError:
            return False
        return manifest.files == files

    async def put_part(self, request: PutDatasetPart) -> TenantReply:
        """Store one part; the last one completes the file (joined, checked, stored)."""
        dataset = validate_id(request.dataset, "dataset id")
        path, index = request.path, request.index
        if len(request.data) > PART_BYTES:
            return CtlError(
                "invalid",
                f"{path}: part {index} has {len(request.data)} bytes, more than the "
                f"{PART_BYTES} a part may have",
            )
        entry = checked_file(ManifestFile(path, request.size, request.sha256))
        parts = part_count(entry.size)
        if request.parts != parts:
            return CtlError(
                "invalid",
                f"{path}: {request.parts} parts for {entry.size} bytes; it travels in "
                f"{parts} parts of {PART_BYTES} bytes",
            )
        if not 0 <= index < parts:
            return CtlError("invalid", f"{path}: part index {index} is not in 0..{parts - 1}")
        expected = entry.size - index * PART_BYTES if index == parts - 1 else PART_BYTES
        if len(request.data) != expected:
            return CtlError(
                "invalid",
                f"{path}: part {index} of {parts} has {len(request.data)} bytes, not {expected}",
            )
        store = await self.store(request.tenant)
        if index < parts - 1:
            # One chunk per part: the join then reads each with a single request.
            name = part_object(dataset, entry.sha256, index)
            await self.put_object(store, request.tenant, path, name, request.data, chunk=PART_BYTES)
            return PartStored(path, index, complete=False)
        await self._join(store, request.tenant, dataset, entry, request.data)
        return PartStored(path, index, complete=True)

    async def _join(
        self, store: ObjectStore, tenant: str, dataset: str, entry: ManifestFile, last: bytes
    ) -> None:
        parts = part_count(entry.size)
        bucket = subjects.tenant_bucket(tenant)
        names = [part_object(dataset, entry.sha256, i) for i in range(parts - 1)]

        async def fetch(i: int) -> bytes:
            try:
                return await self._read_part(store, bucket, names[i])
            except (ObjectNotFoundError, NotFoundError) as exc:
                raise DatasetStoreError(
                    f"{entry.path}: part {i} of {parts} is not stored (the push was started "
                    "again meanwhile?): push the dataset again"
                ) from exc

        with tempfile.TemporaryFile() as joined:
            # Parts are fetched PARALLEL at a time (each read is two round trips) and
            # written in order: at most PARALLEL parts are in memory.
            ahead: dict[int, asyncio.Task[bytes]] = {}
            try:
                for i in range(len(names)):
                    for j in range(i, min(i + PARALLEL, len(names))):
                        if j not in ahead:
                            ahead[j] = asyncio.create_task(fetch(j))
                    joined.write(await ahead.pop(i))
            finally:
                for task in ahead.values():
                    task.cancel()
            joined.write(last)
            size = joined.tell()
            joined.seek(0)
            got = (await asyncio.to_thread(hashlib.file_digest, joined, "sha256")).hexdigest()
            # The parts go before the file is stored: they count against the tenant's
            # storage limit, and a file that fails now is sent again whole anyway.
            await delete_objects(store, names)
            if size != entry.size or got != entry.sha256:
                raise DatasetStoreError(
                    f"{entry.path}: sha256 {got[:16]}… ({size} bytes) does not match the "
                    f"pushed file's {entry.sha256[:16]}… ({entry.size} bytes)"
                )
            joined.seek(0)
            await self.put_object(
                store, tenant, entry.path, prefix_of(dataset) + entry.path, joined
            )
        log.info("push of %s/%s: %s stored (%d bytes)", tenant, dataset, entry.path, size)

    async def _read_part(self, store: ObjectStore, bucket: str, name: str) -> bytes:
        """A stored part: one chunk (see :meth:`put_part`), so one stream message get
        rather than a consumer per part; checked against the object's digest."""
        info = await store.get_info(name)
        if info.size != PART_BYTES:
            # Parts other than the last are stored whole (put_part checked their length).
            raise DatasetStoreError(f"{name}: a stored part of {info.size} bytes is torn")
        if info.chunks != 1:
            buf = io.BytesIO()
            await download(self.js, bucket, name, buf)
            return buf.getvalue()
        msg = await self.js.get_msg(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{info.nuid}")
        data = msg.data or b""
        if len(data) != info.size or hashlib.sha256(data).hexdigest() != object_sha256(info.digest):
            raise DatasetStoreError(f"{name}: object does not match its own digest")
        return data

    async def put_object(
        self,
        store: ObjectStore,
        tenant: str,
        path: str,
        name: str,
        data: bytes | IO[bytes],
        *,
        chunk: int | None = None,
    ) -> None:
        """Put one object (in chunks of ``chunk`` bytes, nats.py's default without); the
        bucket's refusal (its max_bytes, the tenant's storage limit) names the file."""
        meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=chunk))
        try:
            # nats.py takes any reader, though it is typed for BufferedIOBase only.
            await store.put(name, data, meta if chunk else None)  # type: ignore[arg-type]
        except APIError as exc:
            if exc.err_code != STORE_REFUSED:
                raise  # the broker, not the tenant: Queries.answer makes it "unavailable"
            raise DatasetStoreError(
                f"{path}: the bucket {subjects.tenant_bucket(tenant)} refused it: "
                f"{exc.description or exc} (the tenant's storage limit is its bucket's "
                "max_bytes)"
            ) from exc

    async def write_manifest(self, request: AddDataset) -> None:
        """Finish a push: check that every file of ``request.files`` is stored with its
        digest and size, then write the manifest (last: it makes the dataset complete)."""
        assert request.files is not None
        dataset = validate_id(request.dataset, "dataset id")
        files = checked_files(request.files)
        store = await self.store(request.tenant)
        prefix = prefix_of(dataset)
        objects = await objects_under(store, prefix)
        for entry in files:
            info = objects.get(prefix + entry.path)
            if info is None:
                raise DatasetStoreError(f"{entry.path}: not stored: push the dataset again")
            if not _same(info, entry):
                raise DatasetStoreError(
                    f"{entry.path}: the stored object (sha256 "
                    f"{object_sha256(info.digest)[:16]}…, {info.size} bytes) is not the pushed "
                    f"file's ({entry.sha256[:16]}…, {entry.size} bytes): push the dataset again"
                )
        try:
            old, _ = await read_manifest(self.js, subjects.tenant_bucket(request.tenant), dataset)
        except DatasetStoreError:
            old = None
        if old is not None and old.files == files:
            # The same dataset added again: the same manifest, so the same digest, and the
            # copy already materialised is used (not one more copy per request).
            return
        manifest = encode_manifest(DatasetManifest(dataset, files, time.time()))
        await self.put_object(store, request.tenant, MANIFEST, prefix + MANIFEST, manifest)

    # -- policy downloads -------------------------------------------------------------------

    async def read_export(self, request: ReadExport) -> TenantReply:
        """``length`` bytes (0 or more than a part: a part) from ``offset`` of an exported
        policy in the tenant's bucket."""
        tenant, name = request.tenant, request.object_name
        match = _EXPORT_NAME.fullmatch(name)
        if match is None:
            return CtlError(
                "invalid", f"object_name: {name!r} is not an exported policy (policies/<job>/v<n>)"
            )
        validate_id(match.group(1), "job id")
        if request.offset < 0:
            return CtlError("invalid", f"offset: {request.offset} is negative")
        length = request.length if 0 < request.length <= PART_BYTES else PART_BYTES
        store = await self.store(tenant)
        try:
            info = await store.get_info(name)
        except (ObjectNotFoundError, NotFoundError):
            return CtlError("not_found", f"no exported policy {name} of tenant {tenant}")
        size = info.size or 0
        if request.offset > size:
            return CtlError(
                "invalid", f"offset: {request.offset} is past the end of {name} ({size} bytes)"
            )
        if request.offset == size:
            return ExportBytes(request.offset, b"", size)
        for _ in range(3):
            try:
                cached = await self._export(subjects.tenant_bucket(tenant), name, info)
            except (ObjectNotFoundError, NotFoundError):
                return CtlError("not_found", f"exported policy {name} was deleted meanwhile")
            # Evicted (its descriptor closed) between its load and here: load it again. No
            # await between this check and the read, so it cannot be evicted in between.
            if cached.close.alive:
                cached.last_used = time.monotonic()
                return ExportBytes(request.offset, cached.read(request.offset, length), size)
        return CtlError("unavailable", f"{name}: too many exports read at once; ask again", True)

    async def _export(self, bucket: str, name: str, info: ObjectInfo) -> _Cached:
        """The object in the cache; one download however many parts ask at once."""
        key = (bucket, name, info.nuid or "")
        cached = self._exports.get(key)
        if cached is not None:
            self._exports.move_to_end(key)
            return cached
        loading = self._loading.get(key)
        if loading is None:
            loading = asyncio.create_task(self._load(bucket, name, key))
            self._loading[key] = loading
            loading.add_done_callback(lambda _: self._loading.pop(key, None))
        # A requester that goes away must not cancel the download another one awaits.
        return await asyncio.shield(loading)

    async def _load(self, bucket: str, name: str, key: tuple[str, str, str]) -> _Cached:
        cached = _Cached()
        try:
            with cached.writer() as out:
                cached.size = await download(self.js, bucket, name, out)
        except BaseException:
            cached.close()
            raise
        self._exports[key] = cached
        self._evict(keep=key)
        return cached

    def _evict(self, keep: tuple[str, str, str]) -> None:
        """Over :data:`CACHED_EXPORTS` objects, drop the least recently used of those idle
        for :data:`EXPORT_IDLE_S` (one being read in parts stays, or every part would be a
        new download); over :data:`CACHED_EXPORT_BYTES`, the least recently used but
        ``keep``."""
        now = time.monotonic()
        for key, entry in list(self._exports.items()):
            if len(self._exports) <= CACHED_EXPORTS:
                break
            if key != keep and now - entry.last_used > EXPORT_IDLE_S:
                self._exports.pop(key).close()
        for key in list(self._exports):
            if sum(c.size for c in self._exports.values()) <= CACHED_EXPORT_BYTES:
                break
            if key != keep:
                self._exports.pop(key).close()
