"""A tenant's dataset push and policy download, through the master (a tenant's identity has
no JetStream): for a push the files are scanned and hashed here, the master is asked which it
still needs, and each needed file goes in parts of :data:`~schemas.tenantctl.PART_BYTES`; an
exported policy comes back in parts of the same size (:func:`download_export`). The master's side is
:mod:`services.master.transfer`; the layout and checks both sides share are in
:mod:`bus.datasets`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

from bus.codec import encode
from bus.datasets import DatasetStoreError, part_count, scan, sha256_file
from clients.errors import RequestError
from schemas.ids import validate_id
from schemas.tenantctl import (
    PART_BYTES,
    CtlError,
    DatasetPlan,
    ExportBytes,
    PartStored,
    PlanDataset,
    PolicyExported,
    PutDatasetPart,
    ReadExport,
    TenantReply,
    TenantRequest,
)
from schemas.tenants import ManifestFile

T = TypeVar("T")


@dataclass
class PushReport:
    """What a push did: files uploaded, files already there (same digest), and every file
    with its digest (``files``: what :class:`~schemas.tenantctl.AddDataset` then names).
    ``manifest_sha256`` is the digest of the manifest the master wrote (the added dataset's
    record's ``digest``), set by whoever sends the ``dataset-add``."""

    dataset: str
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    manifest_sha256: str = ""
    bytes_uploaded: int = 0
    files: list[ManifestFile] = field(default_factory=list)


#: Sends one tenant request to the master with a timeout (seconds) and returns its reply;
#: the SDK's is :meth:`clients.sdk.Client.request` for one tenant.
Ask = Callable[[TenantRequest, float], Awaitable[TenantReply]]

#: How long a request of a push waits for its answer; the last part of a file waits longer
#: (the master then joins, checks and stores the whole file: :func:`join_timeout`).
PART_TIMEOUT_S = 30.0
#: Parts of one file in flight at once: a round trip per part would otherwise bound the rate.
PARTS_IN_FLIGHT = 4
#: A plan request must stay under the broker's payload limit (1 MiB) with room to spare.
MAX_PLAN_BYTES = 768 * 1024


def join_timeout(size: int) -> float:
    """How long the last part of a ``size``-byte file may take: the master reads every part
    back, hashes the file and stores it again (allow 10 MB/s, and never under a minute)."""
    return max(60.0, size / 10e6)


def _expect(reply: TenantReply, kind: type[T], op: str) -> T:
    """The reply as ``kind``; a :class:`~schemas.tenantctl.CtlError` (from an ``ask`` that
    returns errors rather than raising them) or another reply becomes DatasetStoreError."""
    if isinstance(reply, CtlError):
        raise DatasetStoreError(reply.message, code=reply.code, retryable=reply.retryable)
    if not isinstance(reply, kind):
        raise DatasetStoreError(
            f"{op}: the master answered {type(reply).__name__}", code="unavailable"
        )
    return reply


async def push_dataset(
    ask: Ask,
    tenant: str,
    directory: str | Path,
    dataset_id: str,
    *,
    on_file: Callable[[str], None] | None = None,
) -> PushReport:
    """Upload ``directory`` as dataset ``dataset_id`` of ``tenant`` through the master:
    a :class:`~schemas.tenantctl.PlanDataset` names every file with its digest and the
    master answers which it still needs (a resumed push skips the rest), then each needed
    file goes in :class:`~schemas.tenantctl.PutDatasetPart` pieces. The dataset is complete
    (has a manifest) only once the caller sends ``AddDataset(files=report.files)``.
    ``on_file(path)`` is called after each file is stored (progress; an exception it raises
    stops the push, leaving what was stored for the next push to skip). A tenant's identity
    has no JetStream, so nothing here touches the object store itself."""
    validate_id(tenant, "tenant")
    validate_id(dataset_id, "dataset id")
    root = Path(directory)
    files = await asyncio.to_thread(scan, root)  # hashing every file
    plan_request = PlanDataset(tenant, dataset_id, files)
    if len(encode(plan_request)) > MAX_PLAN_BYTES:
        raise DatasetStoreError(
            f"{root}: {len(files)} files are too many for one push (the file list must stay "
            f"under {MAX_PLAN_BYTES} bytes): pack them into fewer, larger files"
        )
    plan = _expect(await ask(plan_request, PART_TIMEOUT_S), DatasetPlan, "dataset-plan")
    needed = set(plan.needed)
    report = PushReport(dataset_id, files=files)
    for entry in files:
        if entry.path not in needed:
            report.skipped.append(entry.path)
            continue
        await _push_file(ask, tenant, dataset_id, root, entry)
        report.uploaded.append(entry.path)
        report.bytes_uploaded += entry.size
        if on_file is not None:
            on_file(entry.path)
    return report


async def _push_file(
    ask: Ask, tenant: str, dataset_id: str, root: Path, entry: ManifestFile
) -> None:
    """Every part of one file; the last only after the others are stored (it makes the
    master join them)."""
    parts = part_count(entry.size)

    def part(index: int, data: bytes) -> PutDatasetPart:
        return PutDatasetPart(
            tenant, dataset_id, entry.path, index, parts, entry.size, entry.sha256, data
        )

    async def put(index: int, data: bytes, timeout: float) -> PartStored:
        reply = await ask(part(index, data), timeout)
        return _expect(reply, PartStored, "dataset-part")

    def expected(index: int) -> int:
        return entry.size - index * PART_BYTES if index == parts - 1 else PART_BYTES

    async def read(f: BinaryIO, index: int) -> bytes:
        data = await asyncio.to_thread(f.read, PART_BYTES)
        if len(data) != expected(index):
            raise DatasetStoreError(f"{entry.path}: changed while it was pushed; push again")
        return data

    in_flight: set[asyncio.Task[PartStored]] = set()
    with (root / entry.path).open("rb") as f:
        try:
            for index in range(parts - 1):
                if len(in_flight) >= PARTS_IN_FLIGHT:
                    done, in_flight = await asyncio.wait(
                        in_flight, return_when=asyncio.FIRST_COMPLETED
                    )
                    for task in done:
                        task.result()  # the first refusal stops the file
                data = await read(f, index)
                in_flight.add(asyncio.create_task(put(index, data, PART_TIMEOUT_S)))
            await asyncio.gather(*in_flight)
        finally:
            for task in in_flight:
                task.cancel()
        last = await read(f, parts - 1)
        if await asyncio.to_thread(f.read, 1):
            raise DatasetStoreError(f"{entry.path}: changed while it was pushed; push again")
    stored = await put(parts - 1, last, join_timeout(entry.size))
    if not stored.complete:
        raise DatasetStoreError(
            f"{entry.path}: the master did not complete the file after its last part",
            code="unavailable",
            retryable=True,
        )


async def download_export(
    ask: Ask, tenant: str, job_id: str, exported: PolicyExported, out_dir: Path
) -> Path:
    """Read an exported policy (``exported``: the master's answer to an ``export``) in parts
    into ``out_dir`` as ``<job>-v<version>.ckpt``, checked against its SHA-256; returns the
    file. Nothing half written is left: the parts go into a ``.partial`` file first."""
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
    target = out_dir / f"{job_id}-v{exported.version}.ckpt"
    partial = target.with_suffix(".partial")
    try:
        with partial.open("wb") as f:
            offset = 0
            while offset < exported.size:
                # The first read makes the master fetch the whole checkpoint: 60 s.
                read = ReadExport(tenant, exported.object_name, offset, PART_BYTES)
                piece = await ask(read, 60.0)
                if isinstance(piece, CtlError):
                    raise RequestError(piece.message, code=piece.code, retryable=piece.retryable)
                assert isinstance(piece, ExportBytes)
                if piece.size != exported.size or piece.offset != offset or not piece.data:
                    raise RequestError(
                        f"exported policy {exported.object_name} changed while it was read "
                        f"({piece.size} bytes at offset {piece.offset}, expected "
                        f"{exported.size} bytes); export it again",
                        code="unavailable",
                        retryable=True,
                    )
                await asyncio.to_thread(f.write, piece.data)
                offset += len(piece.data)
        got = await asyncio.to_thread(sha256_file, partial)
        if got != exported.sha256:
            raise RequestError(
                f"exported policy {exported.object_name}: sha256 {got} is not {exported.sha256}",
                code="invalid",
                retryable=True,
            )
        await asyncio.to_thread(partial.replace, target)
    except BaseException:
        partial.unlink(missing_ok=True)  # no half-written policy next to the real ones
        raise
    return target
