"""The local cache pushed datasets are materialised into (:func:`bus.datasets.materialise`),
bounded on disk.

One directory per (tenant, dataset id, manifest digest), ``<root>/<tenant>/<id>/<digest16>``,
complete once its ``MANIFEST`` is written; the manifest file's mtime is when the entry was
last used (downloaded, or found by a later materialise). A dataset pushed again gets a new
entry beside the old one, and a process stopped mid-download leaves its ``.partial-*``
directory: without eviction both stay for good. Before each download the least recently
used entries are removed while the cache and the download would hold more than its budget,
except those used in the last ``min_idle_s`` (another process sharing the directory, e.g.
the master and an env worker of one host, may be loading them), and download directories
not written for a day. Processes sharing a root take its lock file (``flock``): shared to
mark an entry used, exclusive to choose and move what goes, so an entry a process has
just found is never removed under it. An entry found with a file missing or of another
size than its manifest says (a cleaner of the temp directory ages files one by one) is
downloaded again instead of failing every job that names it. A loaded dataset is held in
memory (:class:`vla.data.Dataset`): removing its directory costs a later job one download,
never a running job its data.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: A pushed dataset's manifest: the object written last under ``datasets/<id>/`` in the
#: tenant's bucket, and the file written last into a complete entry here (its mtime: when
#: the entry was last used).
MANIFEST = "MANIFEST"
#: An entry used within this long is never removed (a process may be reading it).
MIN_IDLE_S = 3600.0
#: A download directory not written for this long belongs to a process that stopped.
PARTIAL_MAX_AGE_S = 86400.0
#: What the cache may hold on disk by default.
DEFAULT_MAX_BYTES = 64 * 2**30
#: Copies of one dataset id kept (the newest, and the one before for a job still loading
#: it): each push of other contents is a copy of its own, which the idle rule alone kept.
KEEP_VERSIONS = 2

_PARTIAL = ".partial-"
_REMOVING = ".removing-"
_LOCK = ".lock"


def default_cache_root() -> Path:
    """``<tmp>/joynexus-datasets-<uid>`` when a role's config names no cache directory."""
    return Path(tempfile.gettempdir()) / f"joynexus-datasets-{os.getuid()}"


@dataclass(frozen=True)
class DatasetCache:
    """Where this host materialises pushed datasets, and how much disk they may take."""

    root: Path = field(default_factory=default_cache_root)
    #: Bytes the entries may take together (0: no bound). Entries in use may take more.
    max_bytes: int = DEFAULT_MAX_BYTES
    #: An entry used within this long is kept whatever the budget.
    min_idle_s: float = MIN_IDLE_S

    def entry(self, tenant: str, dataset_id: str, digest: str) -> Path:
        """Where ``dataset_id`` of ``tenant`` with manifest ``digest`` is materialised."""
        return self.root / tenant / dataset_id / digest[:16]

    def use(self, entry: Path, sizes: Mapping[str, int]) -> bool:
        """Mark a complete entry as used now; False when it is not there (never complete,
        or removed: materialise it again). Under the cache's shared lock, so an eviction
        running in another process either saw this use or removed the entry before it.

        ``sizes`` (each file's relative path → bytes, from the manifest): an entry missing
        one, or holding one of another size, was cut into by something else (a cleaner of
        the temp directory ages files one by one) and is removed, to be materialised again,
        instead of failing every job that loads it."""
        with self._locked(exclusive=False):
            try:
                os.utime(entry / MANIFEST)
            except FileNotFoundError:
                return False
            if not _damaged(entry, sizes):
                return True
        log.warning(
            "dataset cache: %s lost files since it was written; downloading it again", entry
        )
        with self._locked(exclusive=True):  # another process may have replaced it meanwhile
            if (entry / MANIFEST).exists() and not _damaged(entry, sizes):
                return True
            moved = _rename(entry)
        _delete(moved)
        return False

    def replace(self, entry: Path, complete: Path) -> None:
        """Put the directory ``complete`` (a finished download, its manifest written last)
        at ``entry``, unless another process put the same entry there first; an entry
        without its manifest there (its files cut into) is replaced."""
        try:
            os.rename(complete, entry)
        except OSError:  # not empty: another process's download, or a damaged entry
            with self._locked(exclusive=True):
                if (entry / MANIFEST).exists():
                    return
                moved = _rename(entry)
                os.rename(complete, entry)
            _delete(moved)

    def prune_versions(self, entry: Path, keep: int = KEEP_VERSIONS) -> list[Path]:
        """Remove the copies of ``entry``'s dataset id but the ``keep`` most recently used
        (``entry``, just materialised, among them), however recently used: a tenant pushing
        other contents under one id again and again (alternating two file sets costs its
        storage nothing) made one full copy per push, kept by :attr:`min_idle_s` for an
        hour whatever the budget. Returns the removed paths. Blocking: run it in a thread."""
        with self._locked(exclusive=True):
            copies: list[tuple[float, Path]] = []
            for manifest in entry.parent.glob(f"*/{MANIFEST}"):
                if manifest.parent.name.startswith("."):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    copies.append((manifest.stat().st_mtime, manifest.parent))
            copies.sort(reverse=True)  # the most recently used first
            doomed = [path for _, path in copies[keep:] if path != entry]
            moved = [_rename(p) for p in doomed]
        for gone in moved:
            _delete(gone)
        if doomed:
            log.info("dataset cache: removed %d older copies of %s", len(doomed), entry.parent)
        return doomed

    def evict(self, *, room: int = 0, now: float | None = None) -> list[Path]:
        """Remove download directories left by stopped processes, then the least recently
        used entries idle for ``min_idle_s`` while the cache holds more than ``max_bytes``
        less ``room`` (a download about to start); return the removed paths. Blocking
        (file system walks, the cache's lock): run it in a thread."""
        now = time.time() if now is None else now
        doomed: list[Path] = []
        with self._locked(exclusive=True):
            leftovers = _leftovers(self.root, now)
            entries = sorted(_entries(self.root)) if self.max_bytes > 0 else []
            total = sum(size for _, size, _ in entries)
            budget = max(0, self.max_bytes - room)
            for used, size, path in entries:  # least recently used first
                if total <= budget:
                    break
                if now - used < self.min_idle_s:
                    continue
                log.info(
                    "dataset cache: removing %s (%d bytes, idle %.0fs)", path, size, now - used
                )
                doomed.append(path)
                total -= size
            # Renamed under the lock (a use after it finds them gone), deleted after it.
            moved = [_rename(p) for p in leftovers + doomed]
        for gone in moved:
            _delete(gone)
        if self.max_bytes > 0 and total > budget:
            log.warning(
                "dataset cache %s holds %d bytes, over its %d (%d to come): the rest was used "
                "in the last %.0fs",
                self.root,
                total,
                self.max_bytes,
                room,
                self.min_idle_s,
            )
        return [p for p, m in zip(leftovers + doomed, moved, strict=True) if m is not None]

    @contextlib.contextmanager
    def _locked(self, *, exclusive: bool) -> Iterator[None]:
        """The cache's lock, taken by every process materialising into this root."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.root / _LOCK, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _damaged(entry: Path, sizes: Mapping[str, int]) -> bool:
    """Whether a file of ``sizes`` is missing from ``entry`` or has another size."""
    for path, size in sizes.items():
        try:
            if (entry / path).stat().st_size != size:
                return True
        except FileNotFoundError:
            return True
    return False


def _entries(root: Path) -> list[tuple[float, int, Path]]:
    """Complete entries as (last used, bytes, path)."""
    out = []
    for manifest in root.glob(f"*/*/*/{MANIFEST}"):
        entry = manifest.parent
        if entry.name.startswith("."):
            continue
        try:
            used = manifest.stat().st_mtime
            size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
        except FileNotFoundError:  # removed meanwhile by another process
            continue
        out.append((used, size, entry))
    return out


def _leftovers(root: Path, now: float) -> list[Path]:
    """Download directories not written for a day, and removals a crash interrupted."""
    out = []
    for path in root.glob("*/*/.*"):
        if path.name.startswith(_REMOVING):
            out.append(path)
        elif path.name.startswith(_PARTIAL):
            try:
                written = max([path.stat().st_mtime, *(p.stat().st_mtime for p in path.rglob("*"))])
            except FileNotFoundError:
                continue
            if now - written > PARTIAL_MAX_AGE_S:
                out.append(path)
    return out


def _delete(moved: Path | None) -> None:
    """Delete what :func:`_rename` moved out of the way (outside the lock: it may be big)."""
    if moved is not None:
        shutil.rmtree(moved, ignore_errors=True)


def _rename(path: Path) -> Path | None:
    """Move ``path`` out of the way (a reader never sees an entry half deleted: without its
    manifest it is downloaded again); where it went, or None if it was gone."""
    target = path.parent / f"{_REMOVING}{uuid.uuid4().hex[:12]}"
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return None
    return target
